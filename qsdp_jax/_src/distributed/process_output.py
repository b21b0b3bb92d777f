"""What each process of a run prints and logs: printing from process 0 only, and a log file per
process (the ``qsdp_jax`` logger). Re-exported by :mod:`qsdp_jax.distributed`, where these
functions are documented.

Nothing here starts a JAX backend: the process index and count are read only once
``jax.distributed`` runs (0 and 1 before), so these are safe before
:func:`qsdp_jax.distributed.initialize`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("qsdp_jax")


def process_index() -> int:
    """This process's index (never starts a backend, so it is safe before :func:`initialize`).

    Returns:
      ``jax.process_index()``, or 0 when ``jax.distributed`` is not running.
    """
    if "jax" not in sys.modules:
        return 0
    import jax

    return jax.process_index() if jax.distributed.is_initialized() else 0


def num_processes() -> int:
    """The number of processes (never starts a backend, as :func:`process_index`).

    Returns:
      ``jax.process_count()``, or 1 when ``jax.distributed`` is not running.
    """
    if "jax" not in sys.modules:
        return 1
    import jax

    return jax.process_count() if jax.distributed.is_initialized() else 1


def is_main_process() -> bool:
    """Whether this is process 0: the one that prints progress and writes result files.

    Returns:
      True on process 0 (and in a single-process run).
    """
    return process_index() == 0


def main_print(*args, file=None, **kwargs) -> None:
    """``print`` on process 0 only; every process also logs the line to its own file when
    :func:`enable_process_log` was called.

    Args:
      *args: the values to print, as for ``print``.
      file: as for ``print`` (default: ``sys.stdout``).
      **kwargs: other ``print`` arguments (``sep``, ``end``, ``flush``); ``sep`` also joins the
        logged line.
    """
    msg = kwargs.get("sep", " ").join(str(a) for a in args)
    logger.info(msg)
    if is_main_process():
        print(*args, file=file, **kwargs)


def enable_process_log(directory: str | os.PathLike, level: int = logging.INFO) -> Path:
    """Log the ``qsdp_jax`` logger (and :func:`main_print`) of this process to a file of its own.

    Call after :func:`initialize` (the file is named by the process index). Calling it again for
    the same file adds no second handler. The logger then no longer propagates to the root
    logger (the file, not also every process's stderr).

    Args:
      directory: the directory of the log files (created if missing).
      level: the logger's level, lowered to this if it is higher or unset (default
        ``logging.INFO``).

    Returns:
      The log file's path, ``directory/process_<i>.log`` (``i`` zero-padded to 3 digits).
    """
    path = Path(directory) / f"process_{process_index():03d}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    for h in logger.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve():
            return path
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s p{process_index()} %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # the file, not also every process's stderr (a root handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return path
