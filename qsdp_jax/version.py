"""The version of qsdp_jax, the one place it is written: ``qsdp_jax.__version__`` re-exports it,
pyproject.toml reads it (``[tool.setuptools.dynamic]``, from the file's text: building imports no
JAX), and checkpoints record it (``library_version``). A module of its own so that the modules
of the package read it without importing the package (which imports them)."""

__version__ = "0.1.0"
