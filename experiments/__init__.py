"""Experiment code for qsdp_jax (data pipeline, training scripts); not part of the library."""
