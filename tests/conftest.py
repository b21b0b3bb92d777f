"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
