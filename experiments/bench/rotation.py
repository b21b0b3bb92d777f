"""CPU cost of the blockwise Hadamard rotation (``QSDPConfig.grad_rotation``).

Printed as tables and written as JSON with ``--out``:

* **transform**: ``H x`` per block over a buffer of ``--elements`` float32 values, as the
  butterfly (:func:`qsdp_jax._src.quant.rotation.fwht_butterfly`, log2(block) stages of reshapes), as
  the library's :func:`qsdp_jax._src.quant.rotation.fwht` (a dense ``(n/block, block) @ H`` matmul up to
  block 256, two smaller ones above) and as one dense matmul, for blocks 64..1024, with the
  compile time of each: which one to use on CPU.
* **reduce-scatter**: the quantized reduce-scatter of ``--elements`` per device on 8 simulated
  devices, with and without the rotation.
* **train step** (``--step-preset small``): the GPT train step with and without the rotation.

    python -m experiments.bench.rotation --elements 1048576 --repeat 5 --step-preset small
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _best(fn, args, repeat):
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def transform_times(elements: int, blocks, repeat: int) -> dict:
    """Seconds (best of ``repeat``) of the butterfly and of the dense matmul per block size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qsdp_jax._src.quant import rotation as qr

    x = jnp.asarray(np.random.default_rng(0).normal(size=(elements,)).astype(np.float32))
    out: dict[int, dict[str, float]] = {}
    for b in blocks:
        h = jnp.asarray(qr.hadamard_matrix(b))
        fns = {
            "butterfly": jax.jit(lambda v, b=b: qr.fwht_butterfly(v, b)),
            "library": jax.jit(lambda v, b=b: qr.fwht(v, b)),
            "dense": jax.jit(
                lambda v, h=h, b=b: jnp.matmul(v.reshape(-1, b), h.T, precision=jax.lax.Precision.HIGHEST).reshape(-1)
            ),
        }
        out[b] = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn.lower(x).compile()
            out[b][f"{name}_compile_s"] = time.perf_counter() - t0
            out[b][f"{name}_s"] = _best(fn, (x,), repeat)
    return out


def reduce_scatter_times(elements: int, block: int, bits: int, bucket: int, repeat: int) -> dict:
    """Seconds of one quantized reduce-scatter (8 simulated devices), without / with rotation."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import qsdp_jax as q
    from qsdp_jax import collectives as qc

    mesh = q.make_mesh("fsdp")
    n = len(mesh.devices.reshape(-1))
    full = jnp.asarray(np.random.default_rng(1).normal(size=(n, elements)).astype(np.float32))
    out = {}
    for name, rot in (("plain_s", None), ("rotated_s", block)):

        def f(fb, rot=rot):
            return qc.quantized_reduce_scatter(
                fb[0], bits=bits, bucket=bucket, axis_name="fsdp", key=jnp.uint32(1), rotation=rot
            )

        fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False))
        out[name] = _best(fn, (full,), repeat)
    return out


def step_times(preset: str, block: int, repeats: int, batch: int = 16) -> dict:
    """Median seconds of the GPT train step of ``preset`` (8 simulated devices), QSDP-sr W4G4
    without / with the rotation, steps alternating so that load drift hits both alike."""
    import statistics

    import jax
    import jax.numpy as jnp
    import optax

    import qsdp_jax as q
    from experiments.gpt.model import GPT, GPTConfig  # imports jax: after main sets XLA_FLAGS
    from qsdp_jax import optim

    mesh = q.make_mesh()
    model = GPT(GPTConfig.from_preset(preset))
    params = model.init_params(0)
    seq = model.cfg.seq_len
    data = {"inputs": jnp.zeros((batch, seq), jnp.int32), "targets": jnp.ones((batch, seq), jnp.int32)}
    runs: dict[str, tuple[Any, Any, list[float]]] = {}  # name: (step, state, step times)
    for name, rot in (("plain", None), ("rotated", block)):
        cfg = q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", grad_rotation=rot)
        opt = optim.qsdp(optax.adam(1e-3), cfg)
        state = q.init_train_state(params, opt, mesh, cfg, stacked=model.stacked_groups)
        step = q.make_train_step(model.loss, opt, mesh, cfg, donate=False)
        jax.block_until_ready(step(state, data))  # compile + warm-up
        runs[name] = (step, state, [])
    for _ in range(repeats):
        for step, state, times in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, data))
            times.append(time.perf_counter() - t0)
    return {f"{k}_step_s": statistics.median(v[2]) for k, v in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, default=1 << 20, help="elements per device (default 2^20)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--block", type=int, default=64, help="rotation block of the reduce-scatter timing")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--step-preset", default=None, help="also time the GPT train step of this preset")
    p.add_argument("--step-repeats", type=int, default=8)
    p.add_argument("--out", default=None, help="write the JSON record here")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rec = {
        "elements": a.elements,
        "transform": transform_times(a.elements, (64, 128, 256, 512, 1024), a.repeat),
        "reduce_scatter": {
            "block": a.block,
            "bits": a.bits,
            "bucket": a.bucket,
            **reduce_scatter_times(a.elements, a.block, a.bits, a.bucket, a.repeat),
        },
    }
    print(f"transform of {a.elements} float32 elements (best of {a.repeat}):")
    print("| block | butterfly ms (compile s) | fwht ms (compile s) | one dense matmul ms (compile s) |")
    for b, t in rec["transform"].items():
        print(
            f"| {b} | "
            + " | ".join(
                f"{t[k + '_s'] * 1e3:.2f} ({t[k + '_compile_s']:.2f})" for k in ("butterfly", "library", "dense")
            )
            + " |"
        )
    rs = rec["reduce_scatter"]
    print(
        f"quantized reduce-scatter, {a.elements} elements/device, 8 devices, {a.bits} bits, bucket "
        f"{a.bucket}: plain {rs['plain_s'] * 1e3:.1f} ms, rotated (block {a.block}) "
        f"{rs['rotated_s'] * 1e3:.1f} ms"
    )
    if a.step_preset:
        rec["step"] = {"preset": a.step_preset, "block": a.block, **step_times(a.step_preset, a.block, a.step_repeats)}
        st = rec["step"]
        print(
            f"{a.step_preset} GPT train step, qsdp-sr-W4G4, median of {a.step_repeats}: plain "
            f"{st['plain_step_s'] * 1e3:.1f} ms, rotated (block {a.block}) {st['rotated_step_s'] * 1e3:.1f} ms"
        )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rec, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
