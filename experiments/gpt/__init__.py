"""The GPT example a user can copy: the byte-level GPT (``model``, and ``model_nnx`` as a Flax
NNX module), its data (``data``: tokens, splits and batches of the corpora ``shakespeare`` and
``kjv``; ``files``: atomic writes, strict JSON, the cache directory), one training run
(``trainer``), the trainer CLI (``python -m experiments.gpt.train``, with ``args``,
``arg_types``, ``cluster_args``, ``setup``, ``run_files`` and ``report``), the device choice
(``devices``), ``make demo`` (``demo``) and the NNX-vs-ParamAccess check (``check_nnx``).

It imports only ``qsdp_jax`` and third-party packages, never the other rooms
(:mod:`experiments.shelf`, :mod:`experiments.bench`, :mod:`experiments.convergence`); any of them
may import it. Importing the package, and the CLI's modules, imports no jax: the device flags
are set first.
"""
