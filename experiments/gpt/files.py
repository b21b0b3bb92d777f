"""File helpers of the GPT example: atomic writes, strict JSON, the data cache directory.

* :func:`write_atomic`: write a temporary file beside the target, fsync, rename over it: a reader
  sees the old file or the new one, never half of one. Every file the experiments write that
  must survive a kill goes through it (corpora, run files, convergence records).
* :func:`dumps_strict`: ``json.dumps`` that writes a NaN or infinite number (a diverged loss) as
  the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (:data:`NONFINITE` reads them back).
* :func:`default_cache_dir`: where the corpora's text is cached (``experiments/cache``).

Standard library only (no numpy, no jax): the data pipeline, the trainer CLI and the
convergence records all import it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

PathLike = str | os.PathLike[str]


def write_atomic(path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically: a temporary file in the same directory (created
    with its parents), fsync, rename over it; on any failure the temporary file is removed and
    ``path`` is untouched. ``str`` is written as UTF-8. The file gets the mode of any new file
    (0o666 less the umask), not ``mkstemp``'s private 0o600: a team reads its runs' results."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask (read by setting it, then putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _finite_or_name(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite_or_name(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_name(v) for v in value]
    return value


def dumps_strict(obj, **kwargs) -> str:
    """``json.dumps`` that writes strict JSON: a NaN / infinite float becomes the string
    ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` (bare ``NaN`` is not JSON)."""
    return json.dumps(_finite_or_name(obj), allow_nan=False, **kwargs)


def default_cache_dir() -> Path:
    """``$QSDP_DATA_CACHE`` if set, else ``experiments/cache`` (beside this package)."""
    env = os.environ.get("QSDP_DATA_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "cache"
