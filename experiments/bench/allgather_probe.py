"""Workloads for ``experiments.shelf.multiproc.run_processes``: time all-gathers across processes.

Run inside jax.distributed workers (``run_processes`` has already called
``jax.distributed.initialize``).  Every process runs the same code, as the
multi-controller model requires.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from experiments.shelf.timing import time_alternating

__all__ = ["allgather_probe", "allgather_compare", "crash_probe", "env_probe"]

AXIS = "fsdp"


def _pattern(start: int, stop: int, dtype):
    import numpy as np

    return (np.arange(start, stop, dtype=np.int64) % 251).astype(dtype)


def _setup(num_bytes: int, dtype_name: str, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    dtype = jnp.dtype(dtype_name)
    ndev = jax.device_count()
    n = (int(num_bytes) // dtype.itemsize) // ndev * ndev
    if n <= 0:
        raise ValueError(f"num_bytes={num_bytes} too small for {ndev} devices of {dtype_name}")
    sharding = NamedSharding(mesh, P(AXIS))

    def shard(idx: tuple[slice, ...] | None):
        assert idx is not None  # typed Optional, but jax only ever passes an index (and asserts so)
        return _pattern(idx[0].start or 0, idx[0].stop or n, dtype)

    x = jax.make_array_from_callback((n,), sharding, shard)
    gather = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.all_gather(a, AXIS, tiled=True),
            mesh=mesh,
            in_specs=P(AXIS),
            out_specs=P(),
            check_vma=False,
        )
    )
    return x, gather, n, dtype


def allgather_compare(
    num_bytes: int,
    dtypes: Sequence[str] = ("float32", "uint8"),
    repeats: int = 5,
    warmup: int = 1,
    verify: bool = True,
) -> dict:
    """All-gather a global 1-D array of ``num_bytes`` bytes, per dtype, timed alternately.

    The array is sharded over a 1-D mesh ``("fsdp",)`` of all devices of all
    processes and gathered with a jitted ``shard_map(all_gather(tiled=True))``.
    Same byte count for every dtype, so per-byte cost can be compared.

    Returns (per process) ``{"process_index", "process_count", "device_count",
    "results": {dtype: {"num_bytes", "num_elements", "median_s", ... ,
    "correct", "est_network_bytes"}}}``.  ``est_network_bytes`` is what has to
    cross process boundaries in total: ``(P-1)/P * B`` received by each of the
    P processes, i.e. ``(P - 1) * B`` (ignoring protocol overhead).
    """
    import jax
    import numpy as np

    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    nproc = jax.process_count()
    setups = {d: _setup(num_bytes, d, mesh) for d in dtypes}
    fns = {d: (lambda x=x, g=g: g(x)) for d, (x, g, _, _) in setups.items()}
    timings = time_alternating(fns, repeats=repeats, warmup=warmup, sync=jax.block_until_ready)

    results = {}
    for d, (x, g, n, dtype) in setups.items():
        out = g(x)
        full = np.asarray(out.addressable_data(0))
        ok = (full.shape == (n,)) and (not verify or bool(np.array_equal(full, _pattern(0, n, dtype))))
        nbytes = n * dtype.itemsize
        r = timings[d].to_dict()
        r.update(
            dtype=d,
            num_elements=n,
            num_bytes=nbytes,
            est_network_bytes=(nproc - 1) * nbytes,
            correct=ok,
            checksum=float(full.astype(np.float64).sum()),
        )
        results[d] = r
    return {
        "process_index": jax.process_index(),
        "process_count": nproc,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "results": results,
    }


def allgather_probe(num_bytes: int, dtype: str = "float32", repeats: int = 5, warmup: int = 1) -> dict:
    """Time one all-gather of a ``num_bytes`` global array; returns median seconds and bytes.

    Flat version of ``allgather_compare`` for a single dtype: keys
    ``median_s, min_s, iqr_s, samples_s, first_call_s, num_bytes, dtype,
    correct, checksum, process_index, process_count, device_count, ...``.
    """
    res = allgather_compare(num_bytes, dtypes=(dtype,), repeats=repeats, warmup=warmup)
    flat = dict(res["results"][dtype])
    flat.update({k: v for k, v in res.items() if k != "results"})
    return flat


def crash_probe(fail_process: int = 1, wait_s: float = 60.0) -> dict:
    """Diagnostic: process ``fail_process`` raises; the others block in a barrier.

    Used to test that ``run_processes`` kills the survivors and reports the
    failing process's stderr.
    """
    import jax
    from jax.experimental import multihost_utils

    if jax.process_index() == fail_process:
        raise RuntimeError(f"crash_probe: deliberate failure on process {fail_process}")
    multihost_utils.sync_global_devices("crash_probe")  # never completes
    time.sleep(wait_s)
    return {"process_index": jax.process_index()}


def staggered_failure_probe(delay_s: float = 1.0) -> dict:
    """Diagnostic: every process raises, the last first and each lower index ``delay_s`` later
    (one cause, failing at moments as far apart as start-up times on a loaded machine). Used to
    test that ``run_processes`` reports each process's own error, not only the first."""
    import jax

    time.sleep((jax.process_count() - 1 - jax.process_index()) * delay_s)
    raise RuntimeError(f"staggered_failure_probe: process {jax.process_index()} fails")


def env_probe() -> dict:
    """Diagnostic: what a worker sees (devices, flags, gloo pinning) after one psum."""
    import os

    import jax
    import jax.numpy as jnp
    from jax._src import xla_bridge
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((jax.device_count(),)), NamedSharding(mesh, P(AXIS)))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "platform": jax.devices()[0].platform,
        "sum": float(total.addressable_data(0)),
        "gloo_pinned": bool(getattr(xla_bridge._jax.make_gloo_tcp_collectives, "_qsdp_pinned", False)),
        # jax.config sets its flag attributes at run time, so the type has none: read via getattr
        "collectives": getattr(jax.config, "jax_cpu_collectives_implementation"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
