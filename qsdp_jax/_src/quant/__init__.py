"""qsdp_jax internals: quantizers, the wire format, the weight grid and its codes, randomness, rotation."""
