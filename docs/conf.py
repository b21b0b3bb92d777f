"""Sphinx configuration: MyST Markdown pages, API pages from the docstrings (autodoc + napoleon).

Why Sphinx + MyST rather than MkDocs: the projects our users read daily (JAX, Flax, optax, orbax,
qwix) document themselves this way, so the API pages look and link the way they expect;
autodoc + napoleon read the Google-style docstrings directly; MyST keeps every page Markdown, so
the same files read well on GitHub.

Built by ``make docs`` with warnings as errors (``.ci/run`` runs it before the tests). The results
pages include tables that ``_ext/results_tables.py`` renders from the committed JSON under
``experiments/results/`` with the experiments' own report code, each time the docs are built.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))
# The docs import the package and the report code only: one simulated CPU device is plenty.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import qsdp_jax  # noqa: E402

project = "qsdp_jax"
author = "the qsdp_jax authors"
copyright = "2026, the qsdp_jax authors"
release = version = qsdp_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "results_tables",
]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "results/generated/README.md"]

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields of the class, not a second description of each

html_theme = "furo"
html_title = f"qsdp_jax {release}"
