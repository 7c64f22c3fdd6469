"""Data-parallel serving: replicas, their KV events, and the router in front of them."""
