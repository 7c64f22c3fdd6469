"""The ways ``bench structured`` runs its requests, and their names in its plots.

Both the run (``jump_forward``, ``tool_workloads``) and the plots (``jump_forward_plots``) read them, so they
live apart from either: neither imports the other.
"""

from __future__ import annotations

MODES = ("unconstrained", "no_jump", "jump")  # the workload itself: no schema, token by token, jump-forward
FREE_MODES = ("free", "free_masked")  # fixed-length free text: no grammar, a grammar that forces nothing
MODE_LABELS = {
    "unconstrained": "no schema",
    "no_jump": "schema, token by token",
    "jump": "schema, jump-forward",
    "free": "free text, no grammar",
    "free_masked": "free text, grammar forcing nothing",
}
