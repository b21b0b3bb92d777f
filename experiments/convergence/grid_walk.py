"""Why bf16 statistics and on-grid weights do not mix: a one-tensor simulation.

QSDP keeps weights on their quantization grid: every step quantizes the updated weights onto a
fresh per-bucket grid spanning ``[min, max]``. With float32 statistics the extremes are grid
points, so rounding never widens the range. With bf16 statistics (``stats_dtype="bfloat16"``)
the grid is rounded outward to bf16 values and reaches past the bucket's range; stochastic
rounding puts weights on those outer points, the next step's range is wider, and so on: the
range ratchets outward and the grid coarsens. ``comm`` mode quantizes a float32 master copy
afresh each step (nothing is iterated), so its range does not grow. ``qsdp/lattice`` is an idea
tried here only (:func:`lattice_project`). ``qsdp/golden`` (:func:`golden_project`) is the
golden weight rounding that was built, measured on the GPT and dropped (README, *Convergence*).

Each step adds an Adam-like update (``lr * sign(0.3 * drift + noise)``, per-coordinate) to the
weights; the table reports, against the same walk without quantization, the mean bucket range
ratio and the RMS distance relative to the weights' spread.

    python -m experiments.convergence.grid_walk                      # 4 bits, buckets of 256, 1000 steps
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODES = (("qsdp", "float32"), ("qsdp", "bfloat16"), ("comm", "bfloat16"), ("qsdp", "lattice"), ("qsdp", "golden"))


def lattice_project(x, bits: int, bucket: int, key):
    """An idea simulated, not built: stochastic rounding onto a lattice grid, whose scale is a
    power of 2 and whose offset a multiple of it, so consecutive grids are aligned and a weight
    that did not move is never re-rounded (the price: a step up to 2x the min/max grid's)."""
    import jax.numpy as jnp

    from qsdp_jax._src.quant import quantizers as qz

    top = 2**bits - 1
    xb = x.reshape(-1, bucket)
    lo, hi = xb.min(axis=1), xb.max(axis=1)
    s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum((hi - lo) / top, 1e-30))))
    s = jnp.where(jnp.floor(lo / s) * s + top * s < hi, 2 * s, s)  # the aligned offset may cost a step
    off = jnp.floor(lo / s) * s
    u = qz.hash_uniform(key, jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape))
    q = jnp.minimum(jnp.floor((xb - off[:, None]) / s[:, None] + u), top)
    return (off[:, None] + q * s[:, None]).reshape(x.shape)


def golden_project(x, bits: int, bucket: int, key, step):
    """Built once as ``weight_rounding="golden"``, dropped on the GPT measurements: stochastic
    rounding onto the float32 min/max grid whose uniform per weight is ``frac(u_0 + step *
    0.618...)`` (one key for the whole walk), so a weight's successive rounding errors cancel
    rather than add up as a random walk; each step alone is still unbiased."""
    import jax.numpy as jnp

    from qsdp_jax._src.quant import quantizers as qz

    grid = qz.quantize(x, bits, bucket, "nearest")  # the same fresh grid as stochastic rounding's
    xb = qz.to_buckets(x, bucket)
    ctr = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
    # frac(step * 0.618...): 32-bit fixed point, then rotate each weight's fixed uniform by it
    phase = (jnp.uint32(step) * jnp.uint32(qz.GOLDEN)).astype(jnp.float32) * jnp.float32(2.0**-32)
    u = jnp.mod(qz.hash_uniform(key, ctr) + phase, 1.0)
    s, off = grid.scales[..., None], grid.offsets[..., None]
    t = jnp.where(s == 0, 0.0, (xb - off) / jnp.where(s == 0, 1.0, s))
    q = jnp.clip(jnp.floor(t + u), 0, qz.levels(bits))
    return (off + q * s).reshape(x.shape)


def walk(
    mode: str,
    stats: str,
    bits: int,
    bucket: int,
    steps: int,
    lr: float,
    rows: int = 64,
    checkpoints: tuple[int, ...] = (10, 100, 300, 1000),
) -> dict[int, tuple[float, float]]:
    """``{step: (range ratio, relative RMS distance)}`` of the quantized walk against the exact one."""
    import jax
    import numpy as np

    from qsdp_jax._src.quant import quantizers as qz

    rng = np.random.default_rng(0)
    exact = (rng.normal(size=(rows, bucket)) * 0.02).astype(np.float32)
    drift = rng.normal(size=exact.shape).astype(np.float32)
    rounding: qz.QRounding = "stochastic" if mode == "qsdp" else "nearest"
    golden = stats == "golden"  # one key for the walk, rotated by the step's phase
    if stats == "lattice":
        project = jax.jit(lambda x, k, t: lattice_project(x, bits, bucket, k))
    elif golden:
        project = jax.jit(lambda x, k, t: golden_project(x, bits, bucket, k, t))
    else:
        project = jax.jit(lambda x, k, t: qz.quantize(x, bits, bucket, rounding, k, stats_dtype=stats).dequantize())
    held, out = np.asarray(project(exact, qz.derive_key(1, 0), 0)), {}
    for t in range(1, steps + 1):
        u = lr * np.sign(0.3 * drift + rng.normal(size=exact.shape)).astype(np.float32)
        exact = exact + u
        base = held + u if mode == "qsdp" else exact  # qsdp iterates on the grid; comm re-quantizes
        held = np.asarray(project(base, qz.derive_key(2) if golden else qz.derive_key(2, t), t))
        if t in checkpoints or t == steps:
            ratio = np.ptp(held, axis=1).mean() / np.ptp(exact, axis=1).mean()
            rms = np.sqrt(np.mean((held - exact) ** 2)) / exact.std()
            out[t] = (float(ratio), float(rms))
    return out


def table(result: dict) -> str:
    """The markdown table of a walk: one row per mode/stats, one column per recorded step
    (range ratio / RMS distance). Takes ``main``'s result or the JSON record's (string steps)."""
    steps = sorted(next(iter(result.values())), key=int)
    lines = ["| mode/stats | " + " | ".join(f"step {t}" for t in steps) + " |", "|---|" + "---|" * len(steps)]
    for name, r in result.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[t][0]:.2f} / {r[t][1]:.2f}" for t in steps) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--bucket", type=int, default=256)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    a = p.parse_args(argv)
    if a.steps < 1 or a.lr <= 0:
        p.error(f"--steps {a.steps} must be >= 1 and --lr {a.lr} > 0")
    result = {f"{m}/{s}": walk(m, s, a.bits, a.bucket, a.steps, a.lr) for m, s in MODES}
    print(f"W{a.bits}, buckets of {a.bucket}, lr {a.lr:g}: range ratio / RMS distance vs the exact walk")
    print(table(result))
    if a.out:
        a.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "result": result}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
