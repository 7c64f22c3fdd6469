"""Peer engines (llama.cpp; transformers is e2e's) run in a process of their own, so a peer that crashes
ends only itself."""
