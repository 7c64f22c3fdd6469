"""Per-request isolation under tensor parallelism (spawned gloo workers, tiny Llama): a request whose
forward fails on every rank, on rank 0 only or on a worker only ends alone with the outcome one process
gives it, the group goes on serving; a hung worker, or one killed inside a step, ends the group with an
error for every request in flight, within a bound the test sets, and leaves no process behind; a worker
killed between steps is named by the command that finds it gone.

Faults are keyed on a poison token in the victim's prompt (``tp_faults.py``); a packed step holding it
fails part-way through the forward, after some of the step's all-reduces, on the chosen ranks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hydragen import LLM, SamplingParams
from hydragen.tp import commands
from hydragen.tp.coordinator import Coordinator, TPGroupBroken
from hydragen.tp.group import TPGroup
from tests.helpers.server_helpers import process_alive
from tests.helpers.tp_faults import install, worker_environment

STEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
INNOCENT = [STEM + [30, 31, 32], STEM + [40, 41], [7, 8, 9, 60, 61]]
GREEDY = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=3, ignore_eos=True)
# token -> where its fault fires. "at": the layer whose attention raises (the tiny Llama has 2), or "head".
FAULTS = [
    {"token": 250, "ranks": [0, 1], "at": 1},  # every rank, after 3 of the step's 5 all-reduces
    {"token": 251, "ranks": [0], "at": 0},  # rank 0 only, after the embedding's all-reduce
    {"token": 252, "ranks": [1], "at": 1},  # the worker only
    {"token": 253, "ranks": [1], "at": "head"},  # the worker only, after every all-reduce
    {"token": 254, "ranks": [0, 1], "at": "head"},  # every rank, in the logits
]
NAN = {"token": 247, "ranks": [0, 1], "at": 0, "action": "nan"}  # the victim's logits are NaN, no error
CTRL_C = {"token": 248, "ranks": [0], "at": 1, "action": "interrupt"}  # rank 0, mid-forward
STALL = {"token": 249, "ranks": [1], "at": 1, "action": "stall", "seconds": 120}
SHORT_TIMEOUT = 3.0  # seconds: the collective timeout of the group whose worker hangs


@pytest.fixture(scope="module")
def faulty_pair(tiny_models):
    """(TP = 1, TP = 2) engines on the tiny Llama with FAULTS installed in this process (rank 0, and the
    single process) and in the worker."""
    with pytest.MonkeyPatch.context() as mp:
        install([*FAULTS, NAN, CTRL_C], mp.setattr)
        worker_environment(mp, [*FAULTS, NAN])
        one = LLM(tiny_models["llama"], kv_cache_tokens=4096)
        two = LLM(tiny_models["llama"], kv_cache_tokens=4096, tensor_parallel_size=2)
        yield one, two
        two.close()


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Every request's outcome, stepping the engine directly: (error or None, token ids per sample). The
    requests' ids keep their order (a step's rows are in request-id order among equal contexts)."""
    engine = llm.engine
    pairs = enumerate(zip(prompts, params, strict=True))
    reqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in pairs]
    outs, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
        assert steps < 500, "the engine did not finish"
    usage = engine.kv_usage()
    assert usage["used"] == usage["cached"], usage  # no page leaked by the failure
    return [(o.error, [c.token_ids for c in o.outputs]) for o in (outs[r.request_id] for r in reqs)]


def workload(poison: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Three innocent requests and two victims (one sharing the stem, n = 2; one sampled) in one batch."""
    prompts = [*INNOCENT, STEM + [poison, 33], [poison, 5, 6]]
    return prompts, [GREEDY, SAMPLED, GREEDY, GREEDY, SAMPLED]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"token{f['token']}-ranks{f['ranks']}-at{f['at']}")
def test_a_request_whose_forward_fails_ends_alone_as_in_one_process(faulty_pair, fault) -> None:
    one, two = faulty_pair
    prompts, params = workload(fault["token"])
    got = run(two, prompts, params)
    want = run(one, prompts, params)
    for (error, tokens), (ref_error, ref_tokens) in zip(got[:3], want[:3], strict=True):
        assert error is None and ref_error is None and tokens == ref_tokens  # innocents: untouched
    for error, _ in got[3:]:  # each victim ends alone, with the error of the rank that failed
        assert error is not None and error.startswith("prefill failed: ")
        assert f"injected fault on token {fault['token']} at rank {fault['ranks'][0]}" in error
    if 0 in fault["ranks"]:  # the one process fails the victims just as the group does
        assert [e for e, _ in got[3:]] == [e for e, _ in want[3:]]
    else:  # a fault only a worker has: one process has no worker, and its victims run
        assert all(e is None for e, _ in want[3:])
    # the group goes on: the next batch gives the single process's tokens
    assert run(two, INNOCENT, [GREEDY] * 3) == run(one, INNOCENT, [GREEDY] * 3)


def test_nan_logits_are_not_mistaken_for_a_failed_rank(faulty_pair) -> None:
    """The victim, first in the batch, computes NaN logits without any error: the worker's shard then
    starts with NaN as a failed worker's does, rank 0 asks (REPORT), no worker failed, and the victim ends
    in sampling exactly as in one process."""
    one, two = faulty_pair
    reports = []
    report = two.parallel.coordinator.report
    two.parallel.coordinator.report = lambda: reports.append(report()) or reports[-1]
    prompts, params = [[NAN["token"], 5, 6], *INNOCENT], [SAMPLED, GREEDY, SAMPLED, GREEDY]
    try:
        got = run(two, prompts, params)
    finally:
        del two.parallel.coordinator.report
    want = run(one, prompts, params)
    assert got == want
    assert got[0][0].startswith("sampling failed: ValueError: the model computed NaN")
    assert all(error is None for error, _ in got[1:])
    assert reports and all(r == "" for r in reports)  # asked, and no worker had failed


def test_ctrl_c_inside_a_step_leaves_the_group_in_step(faulty_pair) -> None:
    """Ctrl-C lands while rank 0 is inside a step (after some of its all-reduces): it reaches the caller,
    and the group serves the next call with the single process's tokens."""
    one, two = faulty_pair
    single = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        two.generate([*INNOCENT, STEM + [CTRL_C["token"]]], single, use_tqdm=False)
    assert _tokens(two.generate(INNOCENT, single, use_tqdm=False)) == _tokens(
        one.generate(INNOCENT, single, use_tqdm=False)
    )


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_a_hung_worker_ends_the_group_with_an_error_for_every_request(tiny_models) -> None:
    """The worker hangs inside a step (a stall far longer than the collective timeout the test sets):
    every request in flight gets the group's error once rank 0's collective times out, later requests
    fail at once, and close() leaves no worker."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYDRAGEN_TP_TIMEOUT", str(SHORT_TIMEOUT))
        worker_environment(mp, [STALL])
        llm = LLM(tiny_models["llama"], kv_cache_tokens=4096, tensor_parallel_size=2)
    (worker,) = llm.parallel.procs
    try:
        start = time.monotonic()
        prompts = [*INNOCENT, STEM + [STALL["token"]]]
        with pytest.raises(RuntimeError, match="tensor-parallel group is down") as info:
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < STALL["seconds"] / 4  # the timeout ended it, not the stall
        assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
        with pytest.raises(RuntimeError, match="tensor-parallel group is down"):
            llm.generate(INNOCENT, GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    finally:
        llm.close()
    assert not process_alive(worker.pid)


def test_a_worker_killed_inside_a_step_fails_every_request_in_flight(tiny_models) -> None:
    """SIGKILL (what running out of memory is on a CPU) reaches the worker while rank 0 is inside a step:
    rank 0's next collective fails at once, and every request of the generate call gets the error naming
    the worker and the signal."""
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096, tensor_parallel_size=2)
    (worker,) = llm.parallel.procs
    model, calls = llm.engine.model, []

    class KillsTheWorkerOnItsThirdCall:
        def __call__(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # the third step: the requests are decoding, the STEP was broadcast
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
            return model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    llm.engine.model = KillsTheWorkerOnItsThirdCall()
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(INNOCENT, GREEDY, use_tqdm=False)
        assert len(calls) == 3
        assert time.monotonic() - start < 60  # the collective timeout here is 300 s: seen, not waited out
        assert not llm.engine.has_unfinished()
    finally:
        llm.close()


def test_a_worker_killed_between_steps_is_named_by_the_command_that_finds_it_gone() -> None:
    """Rank 0's next command (a broadcast on the control channel) fails as the dead worker's sockets close,
    a moment before its process can be reaped: the group is down naming the worker, as when an all-reduce
    fails (they wait the same grace for the death to show), not "the ranks could not finish a step"."""

    class PeerGone:  # a gloo group whose peer closed its connections
        def broadcast(self, tensors, opts):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4513")

    looks = []

    def dead_workers() -> list[str]:  # reapable from the third look on: after the broadcast failed
        looks.append(1)
        return ["worker rank 1 (pid 4242) was killed by SIGKILL"] if len(looks) >= 3 else []

    gone = PeerGone()
    coordinator = Coordinator(TPGroup(0, 2, torch.device("cpu"), gone, gone), dead_workers)
    try:
        named = r"group is down: worker rank 1 \(pid 4242\) was killed by SIGKILL$"
        with pytest.raises(TPGroupBroken, match=named):
            coordinator.send(commands.NOOP)
        assert len(looks) == 3  # before the command, when it failed, and once the death showed
    finally:
        coordinator.stop()
