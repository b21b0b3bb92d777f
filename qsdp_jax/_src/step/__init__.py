"""qsdp_jax internals: the train step's shard_map body, its layer scan, ParamAccess inside it, the guards."""
