"""Faults keyed on a request's prompt, injected into the model on chosen ranks (rank 0 is also the one
process of TP = 1): a batch holding a poison token raises, or stalls, at a chosen point of its forward.

``install(faults)`` patches ``DecoderModel`` in this process. Spawned tensor-parallel workers get the same
faults through ``tp_fault_site/sitecustomize.py``: put that folder on ``PYTHONPATH`` and the faults, as
JSON, in ``HYDRAGEN_TEST_FAULTS`` before the workers start (``worker_env``).

A fault: ``{"token": 250, "ranks": [0, 1], "at": 1, "action": "raise"}``. ``at``: the layer whose
attention raises (a tensor-parallel rank runs its layers in Python, between all-reduces), ``"start"``
(before the embedding), or ``"head"`` (the logits, after every all-reduce). A single process runs its
layers in one C++ call, so there every fault fires at the start. ``action``: ``"raise"`` (RuntimeError),
``"stall"`` (sleeps ``seconds``, a hung rank), ``"interrupt"`` (KeyboardInterrupt, as Ctrl-C) or ``"nan"``
(no error: the poison token's attention output at layer ``at`` becomes NaN, and with it the request's
logits, as a model that overflows computes them).

A fault at a worker's start, for a group the server rebuilds: ``{"at": "load", "ranks": [1], "action":
"kill", "while_exists": PATH}``. While PATH exists, a listed rank that reaches its shard's load (after it
joined the group) SIGKILLs itself (``"kill"``: a group that keeps dying at start) or waits there until
PATH is gone (``"stall"``: the test sees the rebuild in progress for as long as it looks). Rank 0 may not
be done joining when a worker is (gloo's handshake is not symmetric): a kill there breaks rank 0's join
or, later, its wait for "loaded"; the launcher names the dead worker either way.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

ENV = "HYDRAGEN_TEST_FAULTS"
SITE = str(Path(__file__).with_name("tp_fault_site"))


def _rank(model) -> int:
    group = getattr(model, "group", None)
    return 0 if group is None else group.rank


def _fire(fault: dict, rank: int) -> None:
    action = fault.get("action", "raise")
    if action == "stall":
        time.sleep(fault.get("seconds", 600))
        return
    if action == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError(f"injected fault on token {fault['token']} at rank {rank}")


def install(faults: list[dict], set_attribute=setattr) -> None:
    """Patch ``DecoderModel.forward`` and ``logits`` (every rank's model class) to fire ``faults``; tests pass
    a MonkeyPatch's ``setattr``, so the patch ends with them."""
    from hydragen.model.decoder import DecoderModel

    _install_load_faults([f for f in faults if f["at"] == "load"], set_attribute)
    faults = [f for f in faults if f["at"] != "load"]
    real_forward, real_logits = DecoderModel.forward, DecoderModel.logits

    def forward(self, input_ids, positions, attention, layers=None, final_norm=True):
        rank = _rank(self)
        hit = [f for f in faults if rank in f["ranks"] and bool((input_ids == f["token"]).any())]
        self._fault_at_head = next((f for f in hit if f["at"] == "head"), None)
        for f in hit:
            if f.get("action") == "nan":  # the layer loop in Python (the same math) to reach its attention
                layers, attention = None, _nan_at(attention, f, input_ids)
            elif f["at"] == "start" or (layers is not None and f["at"] != "head"):
                _fire(f, rank)
            elif f["at"] != "head":
                attention = _failing_at(attention, f, rank)
        return real_forward(self, input_ids, positions, attention, layers, final_norm)

    def logits(self, hidden, normalized=True):
        fault = getattr(self, "_fault_at_head", None)
        if fault is not None:
            self._fault_at_head = None
            _fire(fault, _rank(self))
        return real_logits(self, hidden, normalized)

    set_attribute(DecoderModel, "forward", forward)
    set_attribute(DecoderModel, "logits", logits)


def _install_load_faults(faults: list[dict], set_attribute) -> None:
    if not faults:
        return
    from hydragen.tp import checkpoint

    real_load = checkpoint.load_shard

    def load_shard(model, rank, *args, **kwargs):
        for f in faults:
            if rank not in f["ranks"] or not os.path.exists(f["while_exists"]):
                continue
            if f["action"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            deadline = time.monotonic() + 600
            while os.path.exists(f["while_exists"]) and time.monotonic() < deadline:
                time.sleep(0.02)
        return real_load(model, rank, *args, **kwargs)

    set_attribute(checkpoint, "load_shard", load_shard)


def _failing_at(attention, fault: dict, rank: int):
    def attend(layer, q, k, v):
        if layer == fault["at"]:
            _fire(fault, rank)
        return attention(layer, q, k, v)

    return attend


def _nan_at(attention, fault: dict, input_ids):
    poisoned = input_ids == fault["token"]

    def attend(layer, q, k, v):
        out = attention(layer, q, k, v)
        if layer == fault["at"]:
            out[poisoned] = float("nan")
        return out

    return attend


def worker_environment(monkeypatch, faults: list[dict]) -> None:
    """Make workers spawned from now on install ``faults`` (via sitecustomize)."""
    monkeypatch.setenv(ENV, json.dumps(faults))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [SITE, os.environ.get("PYTHONPATH")] if p))


def install_from_environment() -> None:
    raw = os.environ.get(ENV)
    if raw:
        install(json.loads(raw))
