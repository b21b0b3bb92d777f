"""The device check's Python steps (run by gpu_scripts/ and tpu_scripts/device_check.sh).

    python -m experiments.bench.device_check kernels --out DIR   # every kernel vs the reference
    python -m experiments.bench.device_check step --out DIR      # one GPT step: fp32 FSDP vs QSDP W8G8
    python -m experiments.bench.device_check table DIR           # the summary table of DIR's JSON

``kernels`` runs each kernel on the default device (Triton on a GPU, Mosaic on a TPU,
interpret mode on a CPU) with random data for bits 1..8 and the three roundings, the bucket
cycling over 64..4096, and compares it with the jnp reference jitted on the same device and on the host CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

BUCKETS = (64, 256, 1024, 4096)


def _target(backend: str) -> str:
    return {"gpu": "triton", "cuda": "triton", "tpu": "mosaic_tpu"}.get(backend, "interpret")


def check_kernels(out_dir: Path, bits_list=tuple(range(1, 9))) -> dict:
    import jax
    import numpy as np

    from qsdp_jax import collectives as qc
    from qsdp_jax import kernels as qk
    from qsdp_jax._src.quant import quantizers as qz
    from qsdp_jax.kernels import _pallas as kp

    target = _target(jax.default_backend())
    cpu = jax.devices("cpu")[0]

    def ref(x, key, bits, bucket, rounding):
        qt = qz.quantize(x, bits, bucket, rounding, key)
        v = qt.dequantize()
        return (
            qz.pack_bits(qt.codes, bits),
            qt.scales,
            qt.offsets,
            v,
            qc.sum_rows(v),
            qz.quantize_on_grid(v + 1e-3, qt.scales, qt.offsets, bits, bucket).dequantize(),
        )

    def kern(x, key, bits, bucket, rounding):
        p, s, o = qk.quantize_pack(x, bits, bucket, rounding, key, target=target)
        v, _, _ = qk.project(x, bits, bucket, rounding, key, target=target)
        n = x.shape[-1]
        return (
            p,
            s,
            o,
            qk.unpack_dequantize(p, s, o, bits, bucket, n, target=target),
            qk.unpack_dequantize_sum(p, s, o, bits, bucket, n, target=target),
            qk.snap(v + 1e-3, s, o, bits, bucket, target=target),
        )

    names = ("packed", "scales", "offsets", "dequantized", "sum", "snap")
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    cases = [(b, r) for b in bits_list for r in qz.ROUNDINGS if not (r == "shift" and b == 1)]
    for i, (bits, rounding) in enumerate(cases):
        bucket = BUCKETS[i % len(BUCKETS)]
        if target in kp.TPU_LAYOUT and not kp.tpu_ok(bucket):
            bucket = 128  # the TPU kernels' smallest bucket (smaller ones use the reference there)
        # 28 buckets leave the last row block partial for buckets of 64 and 256 on Triton
        # (every failure of the first H200 run); 32 fill whole blocks at every bucket size
        for n_buckets in (28, 32):
            x = (rng.normal(size=(4, n_buckets // 4 * bucket)) * rng.uniform(0.01, 100)).astype(np.float32)
            key = qz.derive_key(bits, bucket)
            static = dict(bits=bits, bucket=bucket, rounding=rounding)
            got = jax.jit(functools.partial(kern, **static))(x, key)
            on_dev = jax.jit(functools.partial(ref, **static))(x, key)
            on_cpu = jax.jit(functools.partial(ref, **static))(jax.device_put(x, cpu), jax.device_put(key, cpu))
            rb = kp.row_block(n_buckets, bucket, target)
            case = dict(
                bits=bits, rounding=rounding, bucket=bucket, buckets=n_buckets, partial_block=n_buckets % rb != 0
            )
            rows += [_compare(case, name, *arrays) for name, *arrays in zip(names, got, on_dev, on_cpu)]
    out = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "target": target,
        "checks": len(rows),
        "equal_device_ref": sum(r["equal_device_ref"] for r in rows),
        "equal_cpu_ref": sum(r["equal_cpu_ref"] for r in rows),
        "rows": rows,
    }
    (out_dir / "kernel_check.json").write_text(json.dumps(out, indent=1))
    bad = [r for r in rows if not r["equal_device_ref"]]
    print(
        f"kernels ({target}): {out['equal_device_ref']}/{len(rows)} equal to the device reference, "
        f"{out['equal_cpu_ref']}/{len(rows)} to the CPU reference"
    )
    print(_by_block(rows))
    for r in bad[:20]:
        print("  differs:", r)
    return out


def _by_block(rows: list[dict]) -> str:
    """How many checks are equal to the device reference, with partial and with whole blocks."""
    parts = []
    for partial in (True, False):
        sel = [r for r in rows if r.get("partial_block") is partial]
        if sel:
            kind = "a partial last row block" if partial else "whole row blocks"
            parts.append(f"{sum(r['equal_device_ref'] for r in sel)}/{len(sel)} with {kind}")
    return "  " + ", ".join(parts)


def _compare(case: dict, output: str, got, on_dev, on_cpu) -> dict:
    """One output of one case: equal to the reference on the device, on the host CPU, and
    whether the two references agree (a difference of XLA's, not the kernel's)."""
    import numpy as np

    g, d, c = np.asarray(got), np.asarray(on_dev), np.asarray(on_cpu)
    return {
        **case,
        "output": output,
        "equal_device_ref": bool(np.array_equal(g, d)),
        "equal_cpu_ref": bool(np.array_equal(g, c)),
        "device_ref_equals_cpu_ref": bool(np.array_equal(d, c)),
        "mismatches_device_ref": int(np.sum(g != d)),
        **_first_mismatch(g, d),
    }


def _first_mismatch(got, want) -> dict:
    """Where ``got`` first differs from ``want`` and the two values there (nothing if equal)."""
    import numpy as np

    diff = np.argwhere(got != want)
    if not len(diff):
        return {}
    at = tuple(int(i) for i in diff[0])
    return {"first_mismatch": {"index": at, "got": got[at].item(), "want": want[at].item()}}


# (config name, kernels): the default dispatch (the jnp reference on a GPU, the kernels on a TPU)
# against the Pallas kernels in the same step
STEP_ROWS = (("fp32", "auto"), ("qsdp-W8G8", "auto"), ("qsdp-W8G8", "pallas"))


def time_step(out_dir: Path, preset: str = "small", batch: int = 8, repeats: int = 10) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import qsdp_jax as q
    from experiments.gpt.model import GPT, GPTConfig  # imports jax, like every function here

    model = GPT(GPTConfig.from_preset(preset))
    seq = model.cfg.seq_len
    tokens = np.random.default_rng(0).integers(0, 256, size=(batch, seq + 1))
    data = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    mesh = q.make_mesh()
    rows = []
    for name, kernels in STEP_ROWS:
        cfg = dataclasses.replace(q.QSDPConfig.from_name(name), kernels=kernels)
        opt = q.optim.qsdp(optax.adam(1e-4), cfg)
        state = q.init_train_state(model.init_params(0), opt, mesh, cfg, stacked=model.stacked_groups)
        step = q.make_train_step(model.loss, opt, mesh, cfg)
        t0 = time.perf_counter()
        state, m = jax.block_until_ready(step(state, data))
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state, m = jax.block_until_ready(step(state, data))
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "config": name if kernels == "auto" else f"{name} kernels={kernels}",
                "compile_and_first_s": first,
                "step_median_s": float(np.median(times)),
                "loss": float(m["loss"]),
            }
        )
    out = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "preset": preset,
        "n_params": model.count_params(),
        "batch": batch,
        "seq_len": seq,
        "rows": rows,
    }
    (out_dir / "step.json").write_text(json.dumps(out, indent=1))
    return out


def table(out_dir: Path) -> str:
    lines = [f"device check summary ({out_dir})"]
    kc = out_dir / "kernel_check.json"
    if kc.exists():
        k = json.loads(kc.read_text())
        lines.append(
            f"kernels [{k['target']} on {k['device']}]: {k['equal_device_ref']}/{k['checks']} bit-equal "
            f"to the device reference, {k['equal_cpu_ref']}/{k['checks']} to the CPU reference"
        )
        lines.append(_by_block(k["rows"]))
    for bench in sorted(out_dir.glob("kernels_*.json")):
        b = json.loads(bench.read_text())
        lines.append(f"{'pass':24} {'mode':9} {'bits':>4} {'GB/s':>8} {'vs copy':>8}")
        for r in b["rows"]:
            if r["pass"] != "copy":
                lines.append(f"{r['pass']:24} {r['mode']:9} {r['bits']:>4} {r['gb_per_s']:8.1f} {r['vs_copy']:8.2f}")
    st = out_dir / "step.json"
    if st.exists():
        s = json.loads(st.read_text())
        for r in s["rows"]:
            lines.append(
                f"GPT {s['preset']} step {r['config']:28} {1e3 * r['step_median_s']:8.2f} ms "
                f"(first call {r['compile_and_first_s']:.1f} s, loss {r['loss']:.3f})"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["kernels", "step", "table"])
    p.add_argument("dir", nargs="?", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--preset", default="small", help="GPT preset of the step timing")
    p.add_argument("--bits", type=int, nargs="+", default=list(range(1, 9)), help="bit widths to check")
    args = p.parse_args(argv)
    out_dir = args.out or args.dir
    if out_dir is None:
        p.error("give the output folder (--out DIR, or DIR for table)")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.what == "kernels":
        check_kernels(out_dir, args.bits)
    elif args.what == "step":
        time_step(out_dir, preset=args.preset)
    else:
        print(table(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
