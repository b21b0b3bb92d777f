"""qsdp_jax internals: the collectives built on the layout: two levels, TPU wire shapes, gathers and their gradients, take."""
