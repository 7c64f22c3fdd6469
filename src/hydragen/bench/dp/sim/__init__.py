"""The discrete-event simulation of ``bench dp``: replicas behind the real router, each caching prefixes in
the engine's own KV manager, the service times measured on one replica, and the runs at 2 and 8-64
replicas."""
