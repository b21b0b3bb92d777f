"""The convergence study of QSDP against fp32 FSDP (``python -m experiments.convergence``, see
``run``): the configurations and per-run records (``runbook``), paired gaps and their intervals
(``frontier``, ``levers``, ``stats``), wire bits per configuration (``frontier_bits``) and the
one-tensor simulation of why bf16 statistics and on-grid weights do not mix (``grid_walk``).

It may import ``qsdp_jax``, :mod:`experiments.gpt` and :mod:`experiments.shelf`; nothing imports
it but tests, and it does not import :mod:`experiments.bench`.
"""
