"""The speculative-decoding benchmarks' quick runs: ``bench spec-rows`` (verify_rows: forwards of M rows over
a cached prompt) and ``bench spec`` (the workloads, on against off) write their tables, JSON and plots (a
quick run's numbers are noise; the full runs' are in docs/results/spec)."""

from __future__ import annotations

import json

PNG = b"\x89PNG\r\n\x1a\n"


def test_verify_rows_quick(tmp_path):
    from hydragen.bench.spec import verify_rows

    verify_rows.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "verify_rows.json").read_text())
    assert data["quick"] is True
    assert [r["M"] for r in data["rows"]] == [1, 2, 3]
    assert data["rows"][0]["t(M) / t(1)"] == 1.0 and all(r["t(M) ms"] > 0 for r in data["rows"])
    assert (tmp_path / "verify_rows.png").read_bytes().startswith(PNG)


def test_spec_workloads_quick(tmp_path):
    """``hydragen bench spec --quick``: code and chat at batch 1, speculation on against off, its table,
    JSON and plot; the tokens are identical (one prompt at a time shares nothing with another sequence)."""
    from hydragen.bench.spec import workloads

    workloads.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "spec.json").read_text())
    assert data["quick"] is True and [r["workload"] for r in data["rows"]] == ["code", "chat"]
    assert all(r["identical tokens"] == "yes" and r["on tok/s"] > 0 for r in data["rows"])
    assert (tmp_path / "spec.png").read_bytes().startswith(PNG)


def test_every_workload_builds_its_prompts():
    from hydragen.bench.spec import workloads

    for name in workloads.WORKLOADS:
        convs = workloads.prompts_of(name, 3)
        assert len(convs) == 3 and all(c[-1]["role"] == "user" and c[-1]["content"] for c in convs)
        assert workloads.params_of(name, "t0.8", 8).max_tokens == 8
