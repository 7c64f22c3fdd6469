"""``python -m hydragen.bench.spec.verify_rows --quick``: it times forwards of M rows over a cached prompt and
writes its table, JSON and plot (a quick run's numbers are noise; the full run's are in docs/results/spec)."""

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
