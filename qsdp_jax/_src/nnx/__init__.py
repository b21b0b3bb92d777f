"""qsdp_jax internals: the Flax NNX front door's internals."""
