"""Which devices the experiment scripts run on: the real ones, or simulated CPU devices.

* :func:`use_available_devices`: whatever JAX finds (GPU, TPU; on a machine with only a CPU,
  simulated CPU devices). The trainer, ``make demo``.
* :func:`simulate_cpu_devices`: N simulated CPU devices, even where an accelerator is present
  (benchmarks that measure the compiled program, tests, ``--simulate-devices``).

The number of simulated devices (``--xla_force_host_platform_device_count``) is read once, when
jax initialises its backends, so entry points call these before importing jax (or anything
that imports it).
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


def use_available_devices(cpu_devices: int = 8) -> None:
    """Run on whatever JAX finds (GPU, TPU, CPU); call before jax starts its backends.

    Nothing is forced: ``JAX_PLATFORMS`` is left alone, so on a GPU or TPU host
    ``jax.devices()`` are the accelerators. Only the CPU backend is asked for ``cpu_devices``
    simulated devices (``--xla_force_host_platform_device_count``, a flag that touches nothing
    but the CPU backend), so a machine with one CPU and nothing else still has a mesh to shard
    over. A device count already in ``XLA_FLAGS`` is kept. A no-op once jax is imported.
    """
    if isinstance(cpu_devices, bool) or not isinstance(cpu_devices, int) or cpu_devices <= 0:
        raise ValueError(f"the number of CPU devices must be a positive integer, got {cpu_devices!r}")
    if "jax" in sys.modules or _DEVICE_FLAG.search(os.environ.get("XLA_FLAGS", "")):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()


def describe_devices(devices) -> str:
    """``"8 cpu devices (simulated, 1 process)"``, ``"16 gpu devices (NVIDIA H100, 2 processes)"``."""
    devices = list(devices)
    platform = devices[0].platform
    kind = getattr(devices[0], "device_kind", platform)
    nproc = len({d.process_index for d in devices})
    what = "simulated" if platform == "cpu" and len(devices) > nproc else kind
    return f"{len(devices)} {platform} device{'s' * (len(devices) != 1)} ({what}, {nproc} process{'es' * (nproc != 1)})"
