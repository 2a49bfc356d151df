"""Batch jobs in the hub: the manager (queue, watching) and the backends that run them."""
