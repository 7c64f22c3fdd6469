"""Benchmarks that reproduce the papers' measurements on whatever machine runs them."""
