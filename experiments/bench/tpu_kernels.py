"""Every Pallas kernel compiled by the real TPU compiler for each TPU generation, on this host.

    python -m experiments.bench.tpu_kernels                      # v4, v5e, v5p, v6e; bits 1..8
    python -m experiments.bench.tpu_kernels --topologies v5e:2x2 --bits 4 8 --buckets 1024
    python -m experiments.bench.tpu_kernels --senders 64 --out /tmp/tpu_kernels_64.json  # a 64-chip step's sum

Needs libtpu (``pip install -e '.[aot-tpu]'``); no TPU. ``jax.experimental.topologies`` gives
compile-only devices of a named topology, and each kernel (quantize+pack with stochastic and
shift rounding, projection, grid pack, snap, unpack+dequantize, and its sum over ``--senders``
chunks, 3 by default) is
jitted for one of them and compiled by Mosaic: a kernel that does not fit a generation's
scoped VMEM, or uses an operation it lacks, fails here as it would on the chip. Writes
``experiments/results/tpu_kernels.json`` (one row per compile) and prints a table: ok/failed
per (generation, bits, bucket), the compile seconds and the first line of each failure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

from experiments.shelf.targets import tpu_devices

TOPOLOGIES = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2")
KERNELS = (
    "quantize_pack_stochastic",
    "quantize_pack_shift",
    "project_stochastic",
    "grid_pack",
    "snap",
    "unpack_dequantize",
    "unpack_dequantize_sum",
)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "tpu_kernels.json"
ROWS_PER_CASE = 100  # buckets per row of the compiled arrays (3 rows): not a multiple of the row block


@contextlib.contextmanager
def on_device(device):
    """A mesh of ``device`` as the ambient mesh: Pallas reads the TPU generation it lowers for
    from it (with none it asks the default backend, a CPU here)."""
    import jax

    with jax.set_mesh(jax.sharding.Mesh([device], ("one",))):
        yield


def cases(bits_list=range(1, 9), buckets=(1024,)) -> list[tuple[str, int, int]]:
    """``(kernel, bits, bucket)`` for every kernel (no shift rounding at 1 bit)."""
    return [
        (k, b, n) for n in buckets for b in bits_list for k in KERNELS if not (k == "quantize_pack_shift" and b == 1)
    ]


def _kernel_fn(kernel: str, bits: int, bucket: int, senders: int = 3):
    """The jittable call of ``kernel`` and its abstract arguments (``senders`` chunks)."""
    import jax
    import jax.numpy as jnp

    from qsdp_jax import kernels as qk

    n, t = ROWS_PER_CASE * bucket, "mosaic_tpu"
    x = jax.ShapeDtypeStruct((senders, n), jnp.float32)
    stats = jax.ShapeDtypeStruct((senders, ROWS_PER_CASE), jnp.float32)
    packed = jax.ShapeDtypeStruct((senders, n * bits // 8), jnp.uint8)
    key = jnp.uint32(3)
    fns = {
        "quantize_pack_stochastic": (lambda v: qk.quantize_pack(v, bits, bucket, "stochastic", key, target=t), (x,)),
        "quantize_pack_shift": (lambda v: qk.quantize_pack(v, bits, bucket, "shift", key, target=t), (x,)),
        "project_stochastic": (lambda v: qk.project(v, bits, bucket, "stochastic", key, target=t), (x,)),
        "grid_pack": (lambda v, s, o: qk.grid_pack(v, s, o, bits, bucket, target=t), (x, stats, stats)),
        "snap": (lambda v, s, o: qk.snap(v, s, o, bits, bucket, target=t), (x, stats, stats)),
        "unpack_dequantize": (
            lambda p, s, o: qk.unpack_dequantize(p, s, o, bits, bucket, n, target=t),
            (packed, stats, stats),
        ),
        "unpack_dequantize_sum": (
            lambda p, s, o: qk.unpack_dequantize_sum(p, s, o, bits, bucket, n, target=t),
            (packed, stats, stats),
        ),
    }
    return fns[kernel]


def compile_cases(topology: str, todo: list[tuple[str, int, int]], senders: int = 3) -> list[dict]:
    """Compile each case for the first device of ``topology`` (the sum over ``senders``
    chunks: a step on ``senders`` devices); one row per case."""
    import jax

    device = tpu_devices(topology)[0]
    rows = []
    for kernel, bits, bucket in todo:
        fn, args = _kernel_fn(kernel, bits, bucket, senders)
        t0 = time.perf_counter()
        error = None
        try:
            with on_device(device):
                jax.jit(fn, in_shardings=jax.sharding.SingleDeviceSharding(device)).lower(*args).compile()
        except Exception as e:  # a compile failure is the measurement
            error = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)[:300]
        rows.append(
            dict(
                topology=topology,
                device_kind=device.device_kind,
                kernel=kernel,
                bits=bits,
                bucket=bucket,
                ok=error is None,
                error=error,
                compile_s=round(time.perf_counter() - t0, 3),
            )
        )
    return rows


def table(rows: list[dict]) -> str:
    """One line per (topology, bucket, bits): kernels compiled of those tried, seconds, failures."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["topology"], r["device_kind"], r["bucket"], r["bits"]), []).append(r)
    head = f"{'topology':<11}{'chip':<13}{'bucket':>7}{'bits':>5}{'compiled':>10}{'seconds':>9}  failures"
    lines = [head, "-" * len(head)]
    for (topo, kind, bucket, bits), rs in groups.items():
        ok = sum(r["ok"] for r in rs)
        fails = "; ".join(f"{r['kernel']}: {r['error']}" for r in rs if not r["ok"])
        secs = sum(r["compile_s"] for r in rs)
        lines.append(f"{topo:<11}{kind:<13}{bucket:>7}{bits:>5}{f'{ok}/{len(rs)}':>10}{secs:>9.1f}  {fails}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.tpu_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    p.add_argument("--bits", nargs="+", type=int, default=list(range(1, 9)), choices=range(1, 9))
    p.add_argument("--buckets", nargs="+", type=int, default=[128, 1024, 4096])
    p.add_argument("--senders", type=int, default=3, help="chunks the sum kernel adds: a step's device count")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if any(b <= 0 or b % 128 for b in args.buckets):
        p.error("--buckets must be positive multiples of 128 (smaller buckets use the reference on TPU)")
    if args.senders < 1:
        p.error(f"--senders must be a positive integer, got {args.senders}")
    rows = []
    for topo in args.topologies:
        got = compile_cases(topo, cases(args.bits, args.buckets), args.senders)
        print(f"  {topo}: {sum(r['ok'] for r in got)}/{len(got)} compiled", file=sys.stderr, flush=True)
        rows += got
    text = table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import jax

    record = {
        "command": " ".join(["python -m experiments.bench.tpu_kernels", *(argv if argv is not None else sys.argv[1:])]),
        "jax": jax.__version__,
        "libtpu": _libtpu_version(),
        "compiled": sum(r["ok"] for r in rows),
        "cases": len(rows),
        "rows": rows,
        "table": text,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


@functools.cache
def _libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    raise SystemExit(main())
