"""Speculative decoding's benchmarks (issue 43): what verifying drafts costs, measured before it is built."""
