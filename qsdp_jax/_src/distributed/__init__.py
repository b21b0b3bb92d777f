"""qsdp_jax internals: distributed.py's agreement, peer monitor, environment, output, coordination service."""
