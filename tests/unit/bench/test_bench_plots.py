"""The benchmarks' pictures and tables as a reader meets them: plain numbers, words, marked gaps, quick
runs labelled as smoke tests, and every committed figure redrawable from its committed JSON."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import pytest

from hydragen.bench.core.common import QUICK_BANNER, write_table
from hydragen.bench.core.plots import Missing, Panel, draw, label, plain
from tests.helpers.paths import ROOT

RESULTS = ROOT / "docs" / "results" / "bench-cpu"
PNG = b"\x89PNG\r\n\x1a\n"


def _texts(fig) -> dict[str, list[str]]:
    fig.canvas.draw()
    ax = fig.axes[0]
    return {
        "x": [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
        "y": [t.get_text() for t in ax.get_yticklabels() if t.get_text()],
        "legend": [t.get_text() for t in ax.get_legend().get_texts()],
        "figure": [t.get_text() for t in fig.texts] + [fig._suptitle.get_text()],
    }


def test_plain_numbers():
    assert [plain(v) for v in (1, 16, 2048, 16384, 0.25, 0.5, 1.5)] == [
        "1", "16", "2,048", "16,384", "0.25", "0.5", "1.5",
    ]  # fmt: skip


def test_axes_legends_and_gaps_read_without_the_code():
    import matplotlib.pyplot as plt

    series = {
        label("hydragen"): ([1, 4, 16, 64], [25.0, 61.0, 158.0, 314.0]),
        label("noattn"): ([1, 4, 16, 64], [33.0, 78.0, 222.0, 489.0]),
        label("llamacpp"): ([1, 4], [50.0, float("nan")]),
    }
    missing = [
        Missing(label("llamacpp"), 16, "peers run up to n = 4"),
        Missing(label("llamacpp"), 64, "peers run up to n = 4"),
    ]
    fig = draw([Panel(series, missing=missing)], "A title", "n", "tokens/s", logx=True, logy=True)
    text = _texts(fig)
    plt.close(fig)
    assert text["x"] == ["1", "4", "16", "64"]  # where the data are, written plainly
    assert text["y"] and all(
        "^" not in t and "times" not in t and "$" not in t for t in text["x"] + text["y"]
    )
    assert text["legend"] == [
        "hydragen (sharing on)", "attention skipped (ceiling)", "llama.cpp", "not measured",
    ]  # fmt: skip
    notes = "\n".join(text["figure"])
    assert "not measured: llama.cpp at 16, 64 (peers run up to n = 4)" in notes
    assert "not measured: llama.cpp at 4 (within timing noise)" in notes  # a NaN is marked, not dropped


def test_long_titles_wrap_and_quick_runs_say_so():
    import matplotlib.pyplot as plt

    title = "A title long enough that it would run off the edge of the picture if it were not wrapped " * 2
    fig = draw([Panel({"a": ([1, 2], [1.0, 2.0])})], title, "x", "y", quick=True)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for text in [fig._suptitle, *fig.texts]:
        box = text.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, text.get_text()
    assert fig._suptitle.get_text().startswith("QUICK RUN (smoke test, not a measurement)")
    assert any("not a result" in t.get_text() for t in fig.texts)  # across the picture
    plt.close(fig)


def test_tables_say_quick_and_never_print_nan(tmp_path):
    rows = [{"mode": "hydragen", "rate": float("nan")}, {"mode": "nosharing", "rate": 12.5}]
    md = write_table(rows, ["mode", "rate"], tmp_path, "t", "Title", quick=True, params={"n": [1]})
    assert md.count(QUICK_BANNER) == 2  # opens and closes the table
    assert "nan" not in md.lower() and "| hydragen | n/a |" in md and "n/a: not measurable" in md
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["quick"] is True and data["params"] == {"n": [1]} and math.isnan(data["rows"][0]["rate"])
    md = write_table(rows[1:], ["mode", "rate"], tmp_path, "t", "Title")
    assert QUICK_BANNER not in md and "n/a" not in md
    # A quick run says which of its numbers its toy size distorts; a full run has no such line.
    md = write_table(rows, ["mode", "rate"], tmp_path, "t", "Title", quick=True, quick_note="rates are noise")
    assert "**Why some numbers look wrong at this size:** rates are noise" in md
    md = write_table(rows, ["mode", "rate"], tmp_path, "t", "Title", quick_note="rates are noise")
    assert "Why some numbers" not in md
    assert json.loads((tmp_path / "t.json").read_text())["commit"]  # which code made it


@pytest.mark.parametrize("folder", sorted(p.name for p in RESULTS.iterdir() if p.is_dir()))
def test_committed_figures_redraw_from_their_json(tmp_path, folder, capsys):
    """`hydragen bench NAME --replot DIR` redraws each committed figure from the committed JSON alone."""
    from hydragen import cli

    name = {
        "cost-rule-recheck": "cost-rule",
        "cost-rule-v2": "cost-rule",
        "e2e-peers16": "e2e",
        "e2e-peers64": "e2e",
    }.get(folder, folder)
    shutil.copytree(RESULTS / folder, tmp_path / folder)
    for png in (tmp_path / folder).glob("*.png"):
        png.unlink()
    assert cli.main(["bench", name, "--replot", str(tmp_path / folder)]) == 0
    drawn = sorted(p.name for p in (tmp_path / folder).glob("*.png"))
    assert drawn == sorted(p.name for p in (RESULTS / folder).glob("*.png"))
    assert all((tmp_path / folder / p).read_bytes()[:8] == PNG for p in drawn)
    assert capsys.readouterr().out.count(".png") == len(drawn)


def test_replot_needs_a_folder_with_results(tmp_path, capsys):
    from hydragen import cli

    assert cli.main(["bench", "e2e", "--replot"]) == 2
    assert "--replot takes one results folder" in capsys.readouterr().err
    assert cli.main(["bench", "e2e", "--replot", str(tmp_path)]) == 2
    assert "e2e.json not found" in capsys.readouterr().err


@pytest.mark.parametrize("blocked", ["matplotlib", "jsonschema"])
def test_without_the_bench_extra_bench_says_what_to_install(monkeypatch, capsys, blocked):
    """matplotlib and jsonschema are the optional bench extra: without one, `hydragen bench` stops before it
    measures anything, naming the extra, and the code that needs one says the same when called directly."""
    from hydragen import cli
    from hydragen.bench import MissingBenchDependency
    from hydragen.bench.core.plots import pyplot
    from hydragen.bench.structured.jump_forward import is_valid

    monkeypatch.setitem(sys.modules, blocked, None)  # as if not installed
    install = "pip install 'hydragen[bench]'"
    assert cli.main(["bench", "e2e", "--quick", "--out", "never-written"]) == 2
    assert f"error: hydragen bench needs {blocked}, not installed: {install}" in capsys.readouterr().err
    call = pyplot if blocked == "matplotlib" else lambda: is_valid("{}", {"type": "object"})
    with pytest.raises(MissingBenchDependency, match=f"needs {blocked}.*{re.escape(install)}"):
        call()
