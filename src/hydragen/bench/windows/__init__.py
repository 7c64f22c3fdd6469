"""Sliding-window KV measurements (issue 41): KV bytes per token of context with the window-page release
(``kv_bytes``), and the prefix-cache hit rate of a windowed model against a full one (``hit_rate``)."""
