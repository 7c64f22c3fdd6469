"""The errors users and callers catch, in one module every package may import (it imports nothing).

A request's bad parameter (``ParamError``) and a bad engine setting (``ConfigError``) are ``ValueError``s
that name what was wrong, so the server turns them into a 400 naming the parameter and the CLI names the
flag. The engine's own failures say whose they are: ``CannotFit`` ends one request, ``EngineBroken`` ends
every request in flight.
"""

from __future__ import annotations


class ParamError(ValueError):
    """A bad request parameter; ``param`` names it (the server answers 400 with that param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """A bad engine setting; ``name`` is the field (the CLI names its flag instead)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


class CannotFit(RuntimeError):
    """A sequence needs more KV pages than the cache could ever give it (its request fails alone)."""


class EngineBroken(RuntimeError):
    """A failure of the engine itself (not of one request's work): nothing is retried, every request ends."""
