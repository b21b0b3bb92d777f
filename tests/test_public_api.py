"""The names README.md uses resolve after a plain ``import qsdp_jax`` in a fresh interpreter
(the suite's own process has imported most submodules already, which would hide a missing one)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO), capture_output=True,
                          text=True, timeout=120)


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
    from qsdp_jax.checkpoint_record import library_version

    assert library_version() == qsdp_jax.__version__
    assert (Path(qsdp_jax.__file__).parent / "py.typed").is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qsdp_jax.version.__version__"}
