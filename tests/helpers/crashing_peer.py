"""Peers for the peer-process tests, run in a child process (hydragen/bench/peers/peer_process.py) without
llama.cpp: one that answers, and one that builds and then dies of SIGSEGV at its first call, as
llama-cpp-python built with llama.cpp's AMX path does inside llama_decode on an Intel Xeon with AMX."""

from __future__ import annotations

import os
import signal
import sys

import torch


class CountingPeer:
    """Counts its calls: its state lives in the child between calls."""

    vocab = 256

    def __init__(self, start: int = 0) -> None:
        self.count = start

    def step(self) -> tuple[int, int, int]:
        """(its count, its process id, its torch thread count)."""
        self.count += 1
        return self.count, os.getpid(), torch.get_num_threads()

    def fail(self) -> None:
        raise ValueError("the peer refuses")


def step(peer: CountingPeer) -> tuple[int, int, int]:
    return peer.step()


def fail(peer: CountingPeer) -> None:
    peer.fail()


CALLS_ENV = "CRASHING_PEER_CALLS"  # how many calls answer before the crash (default 0)


def crash(what: str) -> None:
    print(f"{what}: about to crash as an AMX llama_decode does", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)


class SegfaultingPeer:
    """A decode peer (llama_peer.Peer's calls) that builds, answers ``$CRASHING_PEER_CALLS`` calls, then dies
    of SIGSEGV: at its next generate, or at the accuracy part's logits."""

    vocab = 256

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.calls_left = int(os.environ.get(CALLS_ENV, "0"))

    def _call(self, what: str) -> None:
        if self.calls_left == 0:
            crash(what)
        self.calls_left -= 1

    def generate(self, prompt: list[int], n: int, tokens: int) -> list[list[int]]:
        self._call("generate")
        return [[1] * tokens for _ in range(n)]

    def generate_prompts(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        self._call("generate_prompts")
        return [[1] * tokens for _ in prompts]

    def __call__(self, ids: list[int]) -> None:
        crash("logits")
