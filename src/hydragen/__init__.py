"""hydragen: LLM inference built around shared prefixes."""
