# `make run` / `make test` set up a project virtualenv (.venv) on first use and run inside it, so a stock
# distribution Python works. PY picks the interpreter that creates it; VENV its folder.
PY ?= python3
VENV ?= .venv
PROMPT ?= Write a haiku about sharing.
BIN := $(VENV)/bin

.PHONY: setup run chat test lint clean-venv

$(VENV)/.setup-done: pyproject.toml .ci/constraints.txt scripts/setup.sh
	PYTHON="$(PY)" VENV="$(VENV)" bash scripts/setup.sh
	touch $@

setup: $(VENV)/.setup-done

run: setup
	$(BIN)/python -m hydragen generate "$(PROMPT)" -n 8 --max-tokens 64

chat: setup
	$(BIN)/python -m hydragen chat

test: setup
	$(BIN)/python -m ruff check src tests
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/python -m ruff check src tests

clean-venv:
	rm -rf $(VENV)
