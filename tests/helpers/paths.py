"""Paths the tests hand to the programs they start: the repository, its ``src`` (for a child's
PYTHONPATH) and ``slowed_hydragen.py`` (the hydragen command with a pause before every engine step)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
SLOWED = str(Path(__file__).with_name("slowed_hydragen.py"))
