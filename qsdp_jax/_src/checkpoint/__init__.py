"""qsdp_jax internals: checkpoint.py's record, restore checks, array item, safety, regrid."""
