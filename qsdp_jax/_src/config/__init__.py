"""qsdp_jax internals: QSDPConfig's field checks and short names."""
