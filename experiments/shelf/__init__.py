"""Shared benchmark machinery: bandwidth-shaped network namespaces (``netns``), multi-process
``jax.distributed`` runs (``multiproc``), alternating timing (``timing``), the per-process
workloads run in those processes (``network_workload``, ``twolevel_workload``,
``failure_workload``), the plain ``jax.jit`` + ``NamedSharding`` FSDP baseline (``gspmd_fsdp``),
the wire bytes of the compiled GPT step against their formula (``wire_bytes``), the results of
the shaped-network benchmarks (``network_results``) and the benchmarks' scheme names
(``schemes``: ``qsdp-W8G8+codes+mu-bf16``).

It may import ``qsdp_jax`` and :mod:`experiments.gpt`; :mod:`experiments.bench` and
:mod:`experiments.convergence` may import it; it imports neither of them.
"""
