"""Shared benchmark machinery: bandwidth-shaped network namespaces (``netns``), multi-process
``jax.distributed`` runs (``multiproc``), alternating timing (``timing``), the per-process
workloads run in those processes (``network_workload``, ``twolevel_workload``,
``failure_workload``) and the plain ``jax.jit`` + ``NamedSharding`` FSDP baseline
(``gspmd_fsdp``).

It may import ``qsdp_jax`` and :mod:`experiments.gpt`; :mod:`experiments.bench` and
:mod:`experiments.convergence` may import it; it imports neither of them.
"""
