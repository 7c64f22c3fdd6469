"""hydragen's C++ CPU ops (step attention, truncated sampling), compiled on the user's machine on first use.

Each op has a pure-torch twin that is used when no compiler works and that the tests hold it to.
"""
