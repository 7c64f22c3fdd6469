"""The thread governor: the cores other programs leave free decide torch's thread count (re-checked as the
engine runs); a fixed --threads is kept, and reported when the machine is busier than it allows."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from hydragen import cpu_threads
from hydragen.cpu_threads import ThreadGovernor, _Sample, other_load


@pytest.fixture(autouse=True)
def keep_torch_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_other_load_takes_this_process_out():
    before = _Sample(busy_s=10.0, own_s=1.0, wall=100.0)
    after = _Sample(busy_s=13.0, own_s=2.0, wall=102.0)  # 3 busy core-seconds in 2 s, 1 of them ours
    assert other_load(before, after) == pytest.approx(1.0)
    assert other_load(before, None) is None
    assert other_load(before, _Sample(10.0, 1.0, 100.01)) is None  # too short to tell


def _scripted(monkeypatch, loads: list[float], cores: int = 2):
    """Samples whose other load is ``loads[i]`` over the i-th window."""
    t = [0.0, 0.0]

    def sample(_cores):
        if loads and t[1] > 0:
            t[0] += loads.pop(0) * 3.0
        t[1] += 3.0
        return _Sample(t[0], 0.0, t[1])

    monkeypatch.setattr(cpu_threads, "_sample", sample)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: list(range(cores)))


def test_automatic_count_follows_the_other_load(monkeypatch):
    _scripted(monkeypatch, [0.1, 1.3, 0.4, 2.5])
    gov = ThreadGovernor()
    gov.check(force=True)
    assert gov.threads == 2  # quiet: every core
    gov.check(force=True)
    assert gov.threads == 1 and "busy" in gov.describe()  # one core busy elsewhere
    gov.check(force=True)
    assert gov.threads == 2  # the other program stopped
    gov.check(force=True)
    assert gov.threads == 1  # never below one
    assert gov.hint() is None  # automatic: nothing to advise


def test_fixed_count_is_kept_and_a_busy_machine_is_reported(monkeypatch):
    _scripted(monkeypatch, [1.6])
    told = []
    gov = ThreadGovernor(2)
    gov.on_busy = told.append
    gov.check(force=True)
    assert gov.threads == 2
    assert gov.hint() is not None and "--threads 1" in gov.hint()
    assert told == [gov.hint()]
    assert "(--threads)" in gov.describe()


def test_checks_are_rate_limited(monkeypatch):
    calls = []
    monkeypatch.setattr(
        cpu_threads, "_sample", lambda cores: calls.append(1) or _Sample(0.0, 0.0, time.monotonic())
    )
    gov = ThreadGovernor()
    for _ in range(100):
        gov.check()
    assert len(calls) == 1  # only the one at start: a check costs a /proc read at most every 2 s


def test_bad_values_are_refused():
    for bad in (0, -1, 2.5, "many"):
        with pytest.raises(ValueError, match="threads"):
            ThreadGovernor(bad)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat (Linux)")
def test_a_busy_program_is_seen_as_other_load():
    cores = cpu_threads.usable_cores()
    before = cpu_threads._sample(cores)
    spinner = multiprocessing.Process(target=_spin, args=(1.5,))
    spinner.start()
    spinner.join()
    after = cpu_threads._sample(cores)
    assert other_load(before, after) >= 0.5  # the spinner (and anything else running) is other load
    assert after.own_s - before.own_s < 0.5  # this process only waited: none of it counted as ours
