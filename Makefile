PY ?= python3
PROMPT ?= Write a haiku about sharing.

.PHONY: setup run test lint
.setup.stamp: pyproject.toml scripts/setup.sh
	PYTHON=$(PY) bash scripts/setup.sh
	touch .setup.stamp

setup: .setup.stamp

run: .setup.stamp
	$(PY) -m hydragen generate "$(PROMPT)" -n 8 --max-tokens 64

test: .setup.stamp
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q

lint: .setup.stamp
	$(PY) -m ruff check src tests
