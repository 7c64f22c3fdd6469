"""Structured outputs and tool calling: jump-forward (``bench structured``), tool calls (``bench tools``),
schemas without ``additionalProperties`` (``bench schema-defaults``) and the grammar engines compared."""
