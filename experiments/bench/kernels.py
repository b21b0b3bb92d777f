"""Throughput of each hot-path pass against a plain device copy of the same bytes.

    python -m experiments.bench.kernels [--elements 4194304] [--bucket 1024] [--bits 8 4]
        [--modes auto] [--repeats 20] [--stages] [--out experiments/results]

Runs on the default backend (no simulated devices). Each pass is what a collective or the
optimizer runs, through the same dispatch (``QSDPConfig.kernels`` mode; ``auto`` = Pallas on
GPU/TPU, the jnp reference on CPU; add ``reference`` on a GPU to compare the kernel with XLA's
fusion of the reference):

* ``grad_quantize_pack``: N=8 chunks, stochastic rounding, packed payload (reduce-scatter send);
* ``weight_grid_pack``: codes on a given grid, packed payload (QSDP all-gather send);
* ``unpack_dequantize``: the gathered payload back to float32 (all-gather receive);
* ``unpack_dequantize_sum``: 8 received chunks to their float32 sum (reduce-scatter receive);
* ``project_shift`` / ``snap``: the optimizer's projection onto a fresh grid, and the snap;
* ``copy`` and ``cast_bf16``: a float32 copy and a float32 -> bfloat16 cast of the same tensor.

Bandwidth is (bytes read + bytes written) / median time; ``vs_copy`` is that as a fraction of
the copy's bandwidth (the GPU target is >= 0.8), ``time_vs_cast`` the time over the cast's (the
CPU target for the quantize + pack passes is <= 2). ``--stages`` adds the stages of the
gradient pass (:func:`stage_passes`). Writes ``kernels_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from experiments.shelf.timing import time_alternating

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"
CHUNKS = 8
TARGET_GPU_VS_COPY = 0.8
TARGET_CPU_VS_CAST = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=1 << 22)
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--modes", nargs="+", default=["auto"], choices=["auto", "reference", "interpret"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--stages",
        action="store_true",
        help="also time the stages of grad_quantize_pack (the CPU floor: see stage_passes)",
    )
    args = p.parse_args(argv)
    if args.elements <= 0 or args.elements % (CHUNKS * args.bucket):
        p.error(f"--elements must be a positive multiple of {CHUNKS} * --bucket")
    if args.repeats <= 0:
        p.error("--repeats must be positive")
    return args


def passes(n: int, bits: int, bucket: int, mode: str):
    """name -> (jitted function, its arguments, bytes read + written)."""
    import jax
    import jax.numpy as jnp

    from qsdp_jax import collectives as qc
    from qsdp_jax import kernels as qk
    from qsdp_jax._src.quant import quantizers as qz

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    key = qz.derive_key(0, 1)
    nb, packed = n // bucket, qz.packed_size(n, bits)
    qt = jax.jit(lambda v: qz.quantize(v, bits, bucket, "nearest"))(x)
    on_grid = qt.dequantize()
    payload = qc.to_payload(qt)
    payload_chunks = jax.jit(
        lambda v: qc.to_payload(qz.quantize(v.reshape(CHUNKS, -1), bits, bucket, "stochastic", key))
    )(x)
    chunk = n // CHUNKS

    def grad_qp(v):
        return qk.select(
            mode,
            lambda a: qc.to_payload(qz.quantize(a, bits, bucket, "stochastic", key), split=True),
            lambda a, target: qc.payload_from_packed(
                *qk.quantize_pack(a, bits, bucket, "stochastic", key, target=target)
            ),
            v.reshape(CHUNKS, -1),
            bucket=bucket,
        )

    def weight_qp(v, s, o):
        return qc.quantize_payload(v, bits=bits, bucket=bucket, grid=(s, o), kernels=mode)

    def unpack(p):
        return qk.select(
            mode,
            lambda a: qc.dequantize_rows(a, n, bits, bucket),
            lambda a, target: qk.unpack_dequantize(
                *qc.split_payload(a, n, bits, bucket), bits, bucket, n, target=target
            ),
            p,
            bucket=bucket,
        )

    def unpack_sum(p):
        return qk.select(
            mode,
            lambda a: qc.dequantize_rows(a, chunk, bits, bucket, summed=True),
            lambda a, target: qk.unpack_dequantize_sum(
                *qc.split_payload(a, chunk, bits, bucket), bits, bucket, chunk, target=target
            ),
            p,
            bucket=bucket,
        )

    def project(v):
        def ref(a):
            q = qz.quantize(a, bits, bucket, "shift", key)
            return q.dequantize(), q.scales, q.offsets

        return qk.select(
            mode, ref, lambda a, target: qk.project(a, bits, bucket, "shift", key, target=target), v, bucket=bucket
        )

    def snap(v, s, o):
        return qk.select(
            mode,
            lambda a, s, o: qz.quantize_on_grid(a, s, o, bits, bucket).dequantize(),
            lambda a, s, o, target: qk.snap(a, s, o, bits, bucket, target=target),
            v,
            s,
            o,
            bucket=bucket,
        )

    stats = 8 * nb
    moved = on_grid + 1e-3
    return {
        "copy": (jax.jit(jnp.copy), (x,), 8 * n),
        "cast_bf16": (jax.jit(lambda a: a.astype(jnp.bfloat16)), (x,), 6 * n),
        "grad_quantize_pack": (jax.jit(grad_qp), (x,), 4 * n + packed + stats),
        "weight_grid_pack": (jax.jit(weight_qp), (on_grid, qt.scales, qt.offsets), 4 * n + 2 * (packed + stats)),
        "unpack_dequantize": (jax.jit(unpack), (payload,), packed + stats + 4 * n),
        "unpack_dequantize_sum": (jax.jit(unpack_sum), (payload_chunks,), packed + stats + 4 * chunk),
        "project_shift": (jax.jit(project), (x,), 8 * n + stats),
        "snap": (jax.jit(snap), (moved, qt.scales, qt.offsets), 8 * n + stats),
    }, payload_chunks


def stage_passes(n: int, bucket: int):
    """The two passes the reference ``grad_quantize_pack`` cannot avoid, each on its own:
    ``stage_minmax`` (the per-bucket min/max pass over the float32 input) and ``stage_hash``
    (the counter hash of every element, as ``quantize`` computes it, written as one byte each,
    without reading the input). Their sum is that pass's floor as XLA:CPU compiles it."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from qsdp_jax._src.quant import quantizers as qz

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    key = qz.derive_key(0, 1)
    nb = n // bucket

    def minmax(v):
        return qz.bucket_range(qz.to_buckets(v.reshape(CHUNKS, -1), bucket))

    def hashed(v):
        counters = lax.iota(jnp.uint32, n).reshape(CHUNKS, -1, bucket)
        return (qz.hash_uniform(key, counters) * 255.0).astype(jnp.uint8)

    return {
        "stage_minmax": (jax.jit(minmax), (x,), 4 * n + 8 * nb),
        "stage_hash": (jax.jit(hashed), (x,), n),
    }


def measure(args) -> dict:
    import jax
    import numpy as np

    rows = []
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    for bits in args.bits:
        # every mode's passes alternate in one rotation: a GPU that speeds up as it warms (the
        # copy ran at 864 GB/s in the first mode's block and 1553 in the next, on an H200)
        # then favours none of them
        by_mode = {}
        for mode in args.modes:
            by_mode[mode], _ = passes(args.elements, bits, args.bucket, mode)
            if args.stages and mode != "interpret":
                by_mode[mode].update(stage_passes(args.elements, args.bucket))
        calls = {
            f"{m}/{name}": (lambda f=f, a=a: f(*a)) for m, fns in by_mode.items() for name, (f, a, _) in fns.items()
        }
        res = time_alternating(calls, repeats=args.repeats, warmup=2, sync=jax.block_until_ready)
        for mode, fns in by_mode.items():
            copy_bw = fns["copy"][2] / res[f"{mode}/copy"].median
            for name, (_, _, nbytes) in fns.items():
                med = res[f"{mode}/{name}"].median
                rows.append(
                    {
                        "mode": mode,
                        "bits": bits,
                        "pass": name,
                        "median_s": med,
                        "iqr_s": res[f"{mode}/{name}"].iqr,
                        "bytes": nbytes,
                        "gb_per_s": nbytes / med / 1e9,
                        "vs_copy": nbytes / med / copy_bw,
                        "time_vs_cast": med / res[f"{mode}/cast_bf16"].median,
                    }
                )
    return {
        "command": "python -m experiments.bench.kernels " + " ".join(sys.argv[1:]),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "platform": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}",
        "elements": args.elements,
        "bucket": args.bucket,
        "chunks": CHUNKS,
        "targets": {"gpu_vs_copy": TARGET_GPU_VS_COPY, "cpu_quantize_pack_time_vs_cast": TARGET_CPU_VS_CAST},
        "rows": rows,
        "median_of": args.repeats,
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "numpy": np.__version__,
    }


def table(out: dict) -> str:
    lines = [
        f"{out['backend']} ({out['device']}), {out['elements']} float32 elements, bucket {out['bucket']}",
        f"{'mode':9} {'bits':>4} {'pass':22} {'ms':>8} {'GB/s':>7} {'vs copy':>8} {'vs cast':>8}",
    ]
    for r in out["rows"]:
        lines.append(
            f"{r['mode']:9} {r['bits']:>4} {r['pass']:22} {1e3 * r['median_s']:8.2f} "
            f"{r['gb_per_s']:7.2f} {r['vs_copy']:8.2f} {r['time_vs_cast']:8.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = measure(args)
    if argv is not None:
        out["command"] = "python -m experiments.bench.kernels " + " ".join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels_{out['backend']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(table(out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
