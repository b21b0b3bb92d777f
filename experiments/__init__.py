"""Experiment code for qsdp_jax (not part of the library), in four rooms that import one way:

``qsdp_jax`` <- :mod:`experiments.gpt` (the GPT example) <- :mod:`experiments.shelf` (shared
benchmark machinery) <- :mod:`experiments.bench` (benchmarks) and :mod:`experiments.convergence`
(the convergence study), the last two independent of each other. ``tests/test_import_graph.py``
checks the direction and that there is no import cycle. ``results/`` holds what the benchmarks
and the study write; ``train_gpt.py`` is the old name of the trainer CLI
(``python -m experiments.train_gpt`` runs :mod:`experiments.gpt.train`).
"""
