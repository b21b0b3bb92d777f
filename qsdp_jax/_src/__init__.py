"""qsdp_jax's internals: the wire format, the layout, the grids, the guards.

Nothing here is public API; names and signatures change without notice. The public API is
what ``qsdp_jax/__init__.py`` exports and the modules it names (``qsdp_jax.collectives``
stays public for people who build their own steps).
"""
