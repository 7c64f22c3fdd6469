"""Command line: ``hydragen generate``, ``hydragen chat``, ``hydragen serve``, ``hydragen bench``.

One module per command (``generate`` also holds ``chat``), ``common`` for what they share and ``parser``
for the flags.
"""

from __future__ import annotations

import sys

from hydragen.cli.common import UsageError, resolve_random_weights, torchrun_worker
from hydragen.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_random_weights(args)  # before anything reads --model (torchrun ranks, serve's checks)
        worker = torchrun_worker(args)
        if worker is not None:
            return worker
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError) as e:  # bad flags, bad input, unreadable model files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a request the engine could not complete (e.g. out of KV cache memory)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
