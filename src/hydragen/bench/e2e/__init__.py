"""Whole generations through ``LLM``: decode throughput with a shared prompt (``bench e2e``), tree-shaped
sharing (``bench tree``), sharing on against off token by token (``bench exactness``), and this checkout
against another (``bench versus``)."""
