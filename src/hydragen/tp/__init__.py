"""Tensor parallelism: one model split over N processes with torch.distributed (docs/tensor_parallel.md).

Data parallelism (whole replicas behind a router) is ``hydragen.dp``."""
