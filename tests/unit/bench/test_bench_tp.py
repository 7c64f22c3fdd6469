"""bench tp: its plots from saved rows (fast), and a quick run end to end (slow: it starts TP groups)."""

from __future__ import annotations

import json

import pytest

from hydragen.bench.tp import step_cost as tp


def _rows() -> list[dict]:
    rows = [{"tp": 1, "threads": th, "batch": b, "step_ms": 10.0 * b / th} for th in (2, 1) for b in (1, 8)]
    rows += [
        {
            "tp": 2,
            "threads": 1,
            "batch": b,
            "step_ms": 6.0 * b,
            "allreduce_ms_per_call": 2.0,
            "idle_allreduce_ms": 0.5,
        }
        for b in (1, 8)
    ]
    return rows


def test_plots_show_each_run_and_both_allreduce_timings(tmp_path) -> None:
    paths = tp.plots({"rows": _rows(), "quick": False}, tmp_path)
    assert [p.name for p in paths] == ["tp_step_time.png", "tp_allreduce_time.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


@pytest.mark.slow
def test_quick_run_writes_table_json_and_plots(tmp_path) -> None:
    tp.main(["--quick", "--out", str(tmp_path), "--batches", "2", "--max-tokens", "2"])
    data = json.loads((tmp_path / "tp.json").read_text())
    split = [r for r in data["rows"] if r["tp"] == 2]
    assert split and all(r["allreduce_calls_per_step"] == 2 * 2 + 1 for r in split)  # 2 layers, + embedding
    assert all(r["idle_allreduce_ms"] > 0 and r["broadcasts_per_step"] == 1 for r in split)
    assert (tmp_path / "tp.md").exists() and (tmp_path / "tp_step_time.png").exists()
