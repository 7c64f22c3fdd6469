"""Tensor parallelism: a decode step at TP = 1 against TP = N (``bench tp``) and an all-reduce alone."""
