"""What speculation reports: vLLM's counters on /metrics (``hydragen_`` names) and a line in `hydragen
generate`'s summary, from a real engine's run."""

from __future__ import annotations

import re
from types import SimpleNamespace

from hydragen import SamplingParams
from hydragen.cli import main
from hydragen.cli.generate import speculation_line
from hydragen.server.metrics import LatencyMetrics
from hydragen.server.metrics_route import metrics_text
from tests.helpers.fake_engine import ScriptedProposer, fake_engine, run


def _client(engine):
    snap = engine.snapshot
    return SimpleNamespace(
        snapshot=lambda: snap, unavailable=lambda: None, tokens_per_second=0.0, restart_count=0
    )


def test_metrics_carry_the_counters_per_position():
    eng = fake_engine(
        64, 4, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "cost_rule": False}
    )
    eng.scheduler.speculator.proposer = ScriptedProposer(lambda s, k: min(k, 2))  # the third always wrong
    eng.add_request([3, 4, 5, 6], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    run(eng)
    m = eng.scheduler.speculator.metrics
    text = metrics_text(_client(eng), LatencyMetrics())
    value = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    assert value("hydragen_spec_decode_num_drafts_total") == m.drafts > 0
    assert value("hydragen_spec_decode_num_draft_tokens_total") == m.draft_tokens
    assert value("hydragen_spec_decode_num_accepted_tokens_total") == m.accepted_tokens
    per = [
        value(rf'hydragen_spec_decode_num_accepted_tokens_per_pos_total\{{position="{j}"\}}')
        for j in range(3)
    ]
    assert per == m.accepted_per_position and per[2] == 0 and per[0] > 0
    off = fake_engine(64, 4)
    assert "spec_decode" not in metrics_text(_client(off), LatencyMetrics())


def test_the_summary_line_says_what_was_verified_and_accepted():
    line = speculation_line(
        {"drafts": 6, "draft_tokens": 15, "accepted_tokens": 12, "acceptance_rate": 0.8,
         "mean_accepted_length": 3.0, "accepted_per_position": [6, 4, 2, 0], "speculated_step_share": 0.75}
    )  # fmt: skip
    assert line == (
        "speculation: 6 verifications of 15 drafted tokens, 12 accepted (80%); 3.00 tokens per verification; "
        "75% of decode steps speculated; accepted per position: 6, 4, 2, 0"
    )
    none = speculation_line({"drafts": 0, "speculated_step_share": 0.0})
    assert none.startswith("speculation: no drafts verified")


def test_generate_prints_it_and_refuses_a_bad_config(capsys):
    prompt = "Repeat exactly: red green blue, red green blue, red green blue, red green blue, red green"
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert (
        main(["generate", prompt, "--temperature", "0", "--max-tokens", "24", "--speculative-config", spec])
        == 0
    )
    err = capsys.readouterr().err
    assert re.search(r"--- speculation: \d+ verifications of \d+ drafted tokens", err), err
    assert main(["generate", "hi", "--speculative-config", '{"method": "eagle"}']) != 0
    assert "--speculative-config method must be one of ngram, suffix" in capsys.readouterr().err
