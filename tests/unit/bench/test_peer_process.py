"""A benchmark peer in a process of its own (hydragen/bench/peers/peer_process.py): calls run there and
answer, an exception comes back as itself, and a peer that dies of SIGSEGV is reported (which peer, the
signal, its last lines) while this process goes on."""

from __future__ import annotations

import os

import pytest
import torch

from hydragen.bench.peers.llamacpp_peer import timer
from hydragen.bench.peers.peer_process import PeerCrashed, PeerProcess, crash_lines, exit_words, in_peer
from tests.helpers.crashing_peer import CountingPeer, SegfaultingPeer, fail, step


def test_a_peer_lives_in_its_own_process_with_this_ones_threads() -> None:
    with PeerProcess("counter", CountingPeer, start=10) as peer:
        first, pid, threads = peer.call(step)
        second, _, _ = in_peer(step)(peer)  # how the benchmarks' timers are called
        assert (first, second) == (11, 12)  # its state stays in the child between calls
        assert pid != os.getpid() and threads == torch.get_num_threads()
        assert peer.call(getattr, "vocab") == 256
        with pytest.raises(ValueError, match="the peer refuses"):
            peer.call(fail)
        assert peer.call(step)[0] == 13  # an exception ends the call, not the peer


def test_a_segfaulting_peer_is_reported_and_this_process_goes_on() -> None:
    peer = PeerProcess("llama.cpp", SegfaultingPeer, "model.gguf", 32, 4, 1)
    with pytest.raises(PeerCrashed) as crashed:
        in_peer(timer)(peer, [1, 2, 3], 1, 4)  # the decode timer, run in the peer's process
    e = crashed.value
    assert e.peer == "llama.cpp" and e.how == "signal 11, SIGSEGV"
    # its own last line, then the fault handler's: the error and the innermost frames, where it crashed
    assert e.last_lines[0] == "generate: about to crash as an AMX llama_decode does"
    assert e.last_lines[1] == "Fatal Python error: Segmentation fault"
    assert [line.rsplit(" in ", 1)[1] for line in e.last_lines[2:]] == ["crash", "_call", "generate"]
    assert str(e).startswith("llama.cpp crashed (signal 11, SIGSEGV); its last output: ")
    with pytest.raises(RuntimeError, match="llama.cpp's process is closed"):
        peer.call(step)
    peer.close()


def test_exit_words_and_the_lines_a_crash_report_quotes() -> None:
    assert exit_words(-9) == "signal 9, SIGKILL"
    assert exit_words(3) == "exit status 3"
    assert crash_lines(["a", "", "b", "c", "d"]) == ["b", "c", "d"]  # no fault handler: the last lines
