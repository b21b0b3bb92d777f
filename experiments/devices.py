"""Simulated CPU devices for the experiment scripts.

The number of simulated devices (``--xla_force_host_platform_device_count``) is read once, when
jax initialises its backends, so entry points call :func:`simulate_cpu_devices` before
importing jax (or anything that imports it).
"""

from __future__ import annotations

import os
import re
import sys

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def simulate_cpu_devices(n: int) -> None:
    """Ask for ``n`` simulated CPU devices. A no-op once jax is imported (its device count is
    then fixed; callers check ``jax.device_count()`` themselves)."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"the number of simulated devices must be a positive integer, got {n!r}")
    if "jax" in sys.modules:
        return
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
