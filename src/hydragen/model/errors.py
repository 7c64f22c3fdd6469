"""The one error type for model files that cannot be read, so every caller can report it in one line."""

from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    """A model file or directory hydragen cannot use. The message names the file and the problem.

    A ValueError, so callers that already treat bad arguments as ValueError (the CLI, the server) report it
    the same way: one line, no traceback.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first non-empty line (library errors can span many)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].strip()
