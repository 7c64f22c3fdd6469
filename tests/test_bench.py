"""The benchmark runs end to end at tiny sizes and writes well-formed results (speed is not checked)."""

from __future__ import annotations

import json

from hydragen.bench.e2e import run as run_e2e
from hydragen.bench.e2e import step_floor_seconds


def test_e2e_quick(tiny_models, tmp_path):
    rows = run_e2e(
        tiny_models["llama"],
        prompt_len=24,
        ns=[1, 3],
        new_tokens=4,
        modes=["hydragen", "nosharing", "noattn"],
        out=tmp_path,
    )
    assert [(r["mode"], r["n"]) for r in rows] == [
        (m, n) for m in ("hydragen", "nosharing", "noattn") for n in (1, 3)
    ]
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert len(data["rows"]) == 6 and data["machine"]
    assert all(r["decode_tok_s"] > 0 and r["time_T"] >= r["time_1"] > 0 for r in data["rows"])
    assert (tmp_path / "e2e.md").read_text().count("\n| hydragen |") == 2


def test_floor_counts_model_and_shared_attention_once():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_layers=30,
        vocab_size=49152,
    )
    flops = step_floor_seconds(cfg, 64, 2048, 1.0)
    params = 30 * (576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536) + 49152 * 576
    assert flops == 2 * params * 64 + 4 * 64 * 9 * 2048 * 64 * 30
