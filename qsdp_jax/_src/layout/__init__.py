"""qsdp_jax internals: how leaves become groups, buffers and blocks; the state sharded like its params."""
