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
# XLA's backend optimizations off (O0, no expensive LLVM passes) for this process and every
# subprocess: about 70% of the suite's CPU time is compiling, and O0 compiles about a third
# faster (five heavy files serially, clean cache: 440 s -> 301 s). A test comparing two programs
# compiled alike still holds at O0; the tests that compare against bits recorded (or seen equal)
# with XLA's defaults carry the `optimized` marker and run with them (`_xla_optimizations`).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_platform(name: str) -> bool:
    try:
        return len(jax.devices(name)) > 0
    except RuntimeError:
        return False


# The slowest files first, slowest at the top (seconds in a serial run beside a CPU hog,
# 2026-12-03, `--junitxml`): with `make test`'s `-n 2 --dist loadfile --no-loadscope-reorder`
# each worker takes the next file when it is free, so a long file left for the end would keep
# one worker busy while the other idles. xdist's own order (most tests first) put single-test
# files such as test_kill_resume (121 s) last. The other files keep their order, after these.
SLOWEST_FIRST = (
    "test_nnx_reshard.py",  # 132 s (2026-12-04, beside the other worker; 3 layers since: 77 s alone)
    "test_trainer_cluster.py",  # 172 s
    "test_bench_network.py",  # 155
    "test_optax_matrix.py",  # 127
    "test_kill_resume.py",  # 121
    "test_multiproc_2level.py",  # 109
    "test_kernels.py",  # 87
    "test_resume_cli.py",  # 87
    "test_bounded_failure.py",  # 80
    "test_reference_bits.py",  # 67
    "test_weight_codes.py",  # 86 (added 2026-12-03, timed alone)
    "test_train.py",  # 66
    "test_checkpoint.py",  # 60
    "test_bit_policy.py",  # 59
    "test_rotation.py",  # 58
    "test_cluster_failures.py",  # 54
    "test_nnx_gpt.py",  # 54
    "test_checkpoint_safety.py",  # 53
    "test_bytes.py",  # 45
    "test_compact_stats.py",  # 45
    "test_bench_comm.py",  # 45
    "test_bench_memory.py",  # 42
)


SUITE_O0 = jax.config.values["jax_disable_most_optimizations"]  # as the environment set it at import


@pytest.fixture(autouse=True)
def _xla_optimizations(request):
    """XLA's default optimizations for tests marked ``optimized`` (and the processes they start),
    the suite's O0 for the rest.

    The flag is read at each compile but is not part of jit's in-memory cache key, so the caches
    are cleared when it changes (rarely: the marked tests sit together in their files).
    """
    want_off = SUITE_O0 and request.node.get_closest_marker("optimized") is None
    if jax.config.values["jax_disable_most_optimizations"] != want_off:
        jax.config.update("jax_disable_most_optimizations", want_off)
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if want_off else "0"  # and its subprocesses
        jax.clear_caches()
    yield


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_tpu = pytest.mark.skip(reason="needs a TPU")
    for item in items:
        if "gpu" in item.keywords and not _has_platform("gpu"):
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and not _has_platform("tpu"):
            item.add_marker(skip_tpu)
