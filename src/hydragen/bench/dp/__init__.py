"""Routing data-parallel replicas (``bench dp``): the policies measured on real replicas, their workload and
the hit-rate ceiling; ``sim/`` is the simulation at 8-64 replicas."""
