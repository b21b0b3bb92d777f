"""The names README.md uses resolve after a plain ``import qsdp_jax`` in a fresh interpreter
(the suite's own process has imported most submodules already, which would hide a missing one)."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120
    )


def test_submodule_namespaces_resolve_after_importing_the_package():
    code = (
        "import qsdp_jax as q\n"
        "assert callable(q.comm.comm_report), q.comm\n"
        "for name in ('collectives', 'nnx', 'optim', 'checkpoint', 'distributed', 'comm'):\n"
        "    assert getattr(q, name).__name__ == 'qsdp_jax.' + name, name\n"
        "missing = [n for n in q.__all__ if not hasattr(q, n)]\n"
        "assert not missing, missing\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'a backend was started at import'\n"
    )
    r = _fresh(code)
    assert r.returncode == 0, r.stderr[-2000:]


def test_version_is_written_once_and_the_package_is_typed():
    import qsdp_jax
    from qsdp_jax._src.checkpoint.record import library_version

    assert library_version() == qsdp_jax.__version__
    assert (Path(qsdp_jax.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qsdp_jax.version.__version__"}


def test_the_top_level_is_the_user_api_and_every_name_has_an_api_page():
    """``qsdp_jax`` exports the user API only (no wire-format or layout internals, which live under
    ``qsdp_jax._src``), and each exported class or function is on a page of docs/api/."""
    import qsdp_jax as q

    internal = {
        "pack_bits",
        "unpack_bits",
        "GatherSpec",
        "TwoLevelSpec",
        "ShardedParams",
        "QTensor",
        "two_level_all_gather",
        "two_level_reduce_scatter",
        "policy",
        "rotation",
    }
    assert not internal & set(q.__all__) and not any(hasattr(q, n) for n in internal)
    api = "\n".join(p.read_text() for p in (REPO / "docs" / "api").glob("*.md"))
    modules = {
        n
        for n in q.__all__
        if getattr(getattr(q, n), "__name__", "").startswith("qsdp_jax.") and type(getattr(q, n)).__name__ == "module"
    }
    undocumented = [
        n
        for n in q.__all__
        if n not in modules and not n.startswith("__") and not re.search(rf"auto\w+:: {re.escape(n)}\b", api)
    ]
    assert not undocumented, f"exported but on no docs/api page: {undocumented}"
    for m in modules:
        assert f"currentmodule:: qsdp_jax.{m}" in api, f"qsdp_jax.{m} has no docs/api page"
