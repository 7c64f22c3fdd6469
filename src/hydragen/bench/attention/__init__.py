"""The attention op alone: shared-prefix attention against per-sequence SDPA (``bench attention``), and the
engine's cost rule for reading a shared node (``bench cost-rule``)."""
