"""The attention microbenchmark runs at tiny sizes and writes well-formed results (speed is not checked)."""

from __future__ import annotations

import json

import pytest
import torch

from hydragen.bench.attention import shared_prefix_op as bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = dict(bw_mib=4, mm_n=64, trials=2, target_s=0.005)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # Tiny kernels on a busy box: intra-op threads only add stalls.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _table_rows(md: str) -> list[list[str]]:
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| shape ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def test_quick_run_writes_well_formed_results(tmp_path):
    rows = bench.run(
        shapes=["paper", "gqa"],
        batch=[1, 3],
        prefix=[0, 16],
        suffix=[8],
        suffix_sweep=[4],
        suffix_at=(3, 16),
        out=tmp_path,
        **TINY,
    )
    points = [(b, p, 8) for p in (0, 16) for b in (1, 3)] + [(3, 16, 4)]
    assert [(r["shape"], r["batch"], r["prefix"], r["suffix"]) for r in rows] == [
        (s, *pt) for s in ("paper", "gqa") for pt in points
    ]

    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["machine"] and len(data["rows"]) == len(rows) == 10
    for r in data["rows"]:
        assert r["status"] == "ok"
        assert r["hydragen_ms"] > 0 and r["baseline_ms"] > 0 and r["trials"] >= 2
        assert 0 < r["hydragen_min_ms"] <= r["hydragen_ms"] and 0 < r["baseline_min_ms"] <= r["baseline_ms"]
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["hydragen_ms"], rel=1e-9)
        assert 0 <= r["max_abs_diff"] <= 1e-4
        for side in ("hydragen", "baseline"):
            assert r[f"{side}_gbps"] == pytest.approx(r[f"{side}_bytes"] / r[f"{side}_ms"] / 1e6, rel=1e-9)
            assert r[f"{side}_gflops"] == pytest.approx(r["flops"] / r[f"{side}_ms"] / 1e6, rel=1e-9)
            assert r[f"{side}_bw_frac"] > 0 and r[f"{side}_mm_frac"] > 0

    # Bytes and FLOPs against the formulas, computed here independently (fp32 = 4 bytes).
    paper = next(
        r for r in data["rows"] if (r["shape"], r["batch"], r["prefix"], r["suffix"]) == ("paper", 3, 16, 8)
    )
    kv_token = 2 * 1 * 128 * 4  # K + V, Hkv = 1, D = 128
    q_io = 2 * 3 * 8 * 128 * 4  # q in + out, Hq = 8
    assert paper["hydragen_bytes"] == 16 * kv_token + 3 * 8 * kv_token + q_io
    assert paper["baseline_bytes"] == 3 * (16 + 8) * kv_token + q_io
    assert paper["flops"] == 4 * 3 * 8 * (16 + 8) * 128
    gqa = next(
        r for r in data["rows"] if (r["shape"], r["batch"], r["prefix"], r["suffix"]) == ("gqa", 3, 16, 4)
    )
    kv_token = 2 * 3 * 64 * 4  # SmolLM2-135M: Hkv = 3, D = 64, Hq = 9
    assert gqa["hydragen_bytes"] == 16 * kv_token + 3 * 4 * kv_token + 2 * 3 * 9 * 64 * 4
    assert gqa["baseline_bytes"] == 3 * 20 * kv_token + 2 * 3 * 9 * 64 * 4
    assert gqa["flops"] == 4 * 3 * 9 * 20 * 64

    md = (tmp_path / "attention.md").read_text()
    table = _table_rows(md)
    assert len(table) == len(rows)
    assert all(len(cells) == len(bench.COLUMNS) and cells[-1] == "ok" for cells in table)
    assert "GB/s" in md and "GFLOP/s" in md  # the calibration ceilings are in the notes
    for name in ("attention_speedup_vs_batch.png", "attention_speedup_vs_suffix.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_oom_guard_skips_points_over_budget(tmp_path):
    # paper fp32: baseline KV = 2 * B * (P + S) * 128 * 4 bytes -> B=1, P=16: 24 KiB; B=4, P=64: 288 KiB.
    rows = bench.run(
        shapes=["paper"],
        batch=[1, 4],
        prefix=[16, 64],
        suffix=[8],
        suffix_sweep=[],
        suffix_at=None,
        mem_budget=100_000,
        out=tmp_path,
        **TINY,
    )
    status = {(r["batch"], r["prefix"]): r["status"] for r in rows}
    assert status[(1, 16)] == "ok"
    assert status[(4, 64)].startswith("skipped (OOM guard")
    assert "hydragen_ms" not in next(r for r in rows if r["batch"] == 4 and r["prefix"] == 64)
    md = (tmp_path / "attention.md").read_text()
    assert len(_table_rows(md)) == 4 and "OOM guard" in md
    assert (tmp_path / "attention_speedup_vs_batch.png").read_bytes()[:8] == PNG_MAGIC


def test_disagreement_fails_loudly(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "shared_prefix_attention", lambda q, *a, **k: torch.zeros_like(q) + 1.0)
    with pytest.raises(RuntimeError, match="disagree"):
        bench.run(shapes=["paper"], batch=[2], prefix=[8], suffix=[4], suffix_sweep=[], out=tmp_path, **TINY)


def test_main_quick(tmp_path, capsys):
    bench.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| shape | batch | prefix |" in out
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["rows"] and all(r["status"] == "ok" for r in data["rows"])
    assert (tmp_path / "attention_speedup_vs_suffix.png").read_bytes()[:8] == PNG_MAGIC
