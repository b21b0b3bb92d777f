"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, for this process and every subprocess a test starts (the
# trainer's lives, multi-process workers): the suite compiles the same steps many times over,
# and a hit returns the same executable, so the numbers are the same. Empty on a clean clone.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax-compilation"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_platform(name: str) -> bool:
    try:
        return len(jax.devices(name)) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_tpu = pytest.mark.skip(reason="needs a TPU")
    for item in items:
        if "gpu" in item.keywords and not _has_platform("gpu"):
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and not _has_platform("tpu"):
            item.add_marker(skip_tpu)
