"""The benchmarks, one command each (``python -m experiments.bench.<name>``): wire bytes
(``comm``), memory (``memory``), shaped-network wall clock (``network``, ``twolevel``), compute
overhead (``overhead``), kernels (``kernels``), gradient rotation (``rotation``), the compiled
programs' step-time model scaled to more nodes (``speedup_model``), the accelerator check (``device_check``) and the all-gather probes
run by the multi-process tests (``allgather_probe``). Results go under ``experiments/results/``.

It may import ``qsdp_jax``, :mod:`experiments.gpt` and :mod:`experiments.shelf`; nothing imports
it but tests, and it does not import :mod:`experiments.convergence`.
"""
