"""What quantization costs in compute and compile time, with no bandwidth limit.

    python -m experiments.bench.overhead [--preset small] [--repeats 20] [--compiles 3]

On 8 simulated CPU devices in one process, for one GPT preset, measures alternately (so that
load drift hits every config alike):

* the median train-step time of QSDP W8G8 and W4G4 and of fp32 FSDP (warm-up excluded), and of
  QSDP with only the weights quantized (W8GF32) or only the gradients (WF32G8), which splits
  the overhead between the two paths;
* the same for the plain GSPMD FSDP step a JAX user would write (``gspmd``: ``jax.jit`` +
  ``NamedSharding``, :mod:`experiments.shelf.gspmd_fsdp`), in the same rotation, so that the table
  also gives fp32 FSDP's step and compile time over GSPMD's (``x gspmd``);
* code-held weights (``+codes``, ``QSDPConfig(weight_storage="codes")``) against their
  float32-held twin (``x held``);
* the compile time of each step (a fresh ``make_train_step`` each time, so nothing is cached),
  repeated ``--compiles`` times in rotation, median.

Targets (DESIGN.md section 5): step-time ratio QSDP/fp32 <= 1.15 and compile-time ratio
<= 1.5. On simulated devices the "collectives" are memory copies inside one process, so smaller
payloads can make the quantized step *faster* than fp32: the ratio bounds the compute cost of
quantizing, it is not a network speedup. Writes ``experiments/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from experiments.gpt.devices import simulate_cpu_devices
from experiments.shelf.schemes import scheme_config, split_scheme
from experiments.shelf.timing import format_results, time_alternating

GSPMD = "gspmd"
# W8GF32 and WF32G8 split the cost between the weight path and the gradient path; +codes holds
# the weights as their codes (its twin without the suffix holds them as float32)
SCHEMES = ("fp32", "qsdp-W8G8", "qsdp-W4G4", "qsdp-W8GF32", "full-WF32G8", "qsdp-W8G8+codes", "qsdp-W4G4+codes")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"
TARGET_STEP_RATIO = 1.15
TARGET_COMPILE_RATIO = 1.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compiles", type=int, default=3)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("batch", "repeats", "compiles", "devices"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import qsdp_jax as q
    from experiments.gpt.model import GPT, GPTConfig  # imports jax: after simulate_cpu_devices
    from experiments.shelf import gspmd_fsdp  # imports jax, likewise

    overrides = {} if args.seq_len is None else {"seq_len": args.seq_len}
    model = GPT(GPTConfig.from_preset(args.preset, **overrides))
    seq = model.cfg.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(args.batch, seq + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    mesh = q.make_mesh()
    params = model.init_params(0)
    configs = {name: scheme_config(name) for name in SCHEMES}
    optimizers = {k: q.optim.qsdp(optax.adam(1e-4), c) for k, c in configs.items()}
    states: dict[str, Any] = {  # a TrainState per config; GSPMD's: (params, opt_state)
        k: q.init_train_state(params, optimizers[k], mesh, c, stacked=model.stacked_groups) for k, c in configs.items()
    }
    # the plain GSPMD step, from the same parameters and with the same optimizer
    gspmd_opt = optax.adam(1e-4)
    gspmd_sh = jax.tree.map(lambda a: a.sharding, gspmd_fsdp.abstract_state(model, mesh, gspmd_opt))
    gspmd_params = jax.device_put(params, gspmd_sh[0])
    states[GSPMD] = (gspmd_params, jax.jit(gspmd_opt.init, out_shardings=gspmd_sh[1])(gspmd_params))

    def make_step(k):
        if k == GSPMD:
            return gspmd_fsdp.make_step(model, gspmd_opt, mesh)
        return q.make_train_step(model.loss, optimizers[k], mesh, configs[k])

    def lower(k, step):
        return step.lower(*states[k], batch) if k == GSPMD else step.lower(states[k], batch)

    # compile time: fresh jitted steps, compiled in rotation, after one compile not timed (the
    # process's first compile pays one-time costs: 4.0 s against 2.6 s for fp32's second)
    names = [*configs, GSPMD]
    lower(names[0], make_step(names[0])).compile()
    compile_s: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.compiles):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            step = make_step(k)
            t0 = time.perf_counter()
            lower(k, step).compile()
            compile_s[k].append(time.perf_counter() - t0)

    # step time: alternate, carrying each config's state through its own calls
    steps = {k: make_step(k) for k in names}

    def runner(k):
        def call():
            if k == GSPMD:
                *states[k], loss = steps[k](*states[k], batch)
                return loss
            states[k], metrics = steps[k](states[k], batch)
            return metrics

        return call

    results = time_alternating(
        {k: runner(k) for k in names}, repeats=args.repeats, warmup=args.warmup, sync=jax.block_until_ready
    )
    med = {k: results[k].median for k in names}
    comp = {k: float(np.median(v)) for k, v in compile_s.items()}
    rows = []
    for k in names:
        rows.append(
            {
                "config": k,
                "step_median_s": med[k],
                "step_iqr_s": results[k].iqr,
                "step_samples_s": list(results[k].samples),
                "compile_median_s": comp[k],
                "compile_samples_s": compile_s[k],
                "step_ratio_vs_fp32": med[k] / med["fp32"],
                "compile_ratio_vs_fp32": comp[k] / comp["fp32"],
                "step_ratio_vs_gspmd": med[k] / med[GSPMD],
                "compile_ratio_vs_gspmd": comp[k] / comp[GSPMD],
            }
        )
        twin = split_scheme(k)[0]
        if twin != k:  # a code-held config against its float32-held twin
            rows[-1]["step_ratio_vs_float32_held"] = med[k] / med[twin]
    out = {
        "command": "python -m experiments.bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "n_params": model.count_params(),
        "batch": args.batch,
        "seq_len": seq,
        "n_devices": jax.device_count(),
        "platform": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} ({jax.default_backend()})",
        "targets": {"step_ratio": TARGET_STEP_RATIO, "compile_ratio": TARGET_COMPILE_RATIO},
        "note": "simulated devices: collectives are in-process copies; ratios bound the compute cost of quantizing",
        "rows": rows,
        "fp32_vs_gspmd": {"step_ratio": med["fp32"] / med[GSPMD], "compile_ratio": comp["fp32"] / comp[GSPMD]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(out, indent=1))
    print(format_results(results))
    print(table(out))
    return 0


def table(out: dict) -> str:
    lines = [
        f"{out['preset']} preset ({out['n_params'] / 1e6:.2f}M params), batch {out['batch']}x{out['seq_len']}, "
        f"{out['n_devices']} simulated devices",
        f"{'config':<16}{'step ms':>10}{'x fp32':>9}{'x gspmd':>9}{'x held':>8}{'compile s':>12}{'x fp32':>9}"
        f"{'x gspmd':>9}",
    ]
    for r in out["rows"]:
        # the targets bound QSDP against fp32 FSDP; the GSPMD baseline is not held to them
        baseline = r["config"] == GSPMD
        ok_s = "" if baseline or r["step_ratio_vs_fp32"] <= out["targets"]["step_ratio"] else " (over target)"
        ok_c = "" if baseline or r["compile_ratio_vs_fp32"] <= out["targets"]["compile_ratio"] else " (over target)"
        vs_s, vs_c = (
            f"{r[k]:>9.3f}" if k in r else f"{'-':>9}" for k in ("step_ratio_vs_gspmd", "compile_ratio_vs_gspmd")
        )
        held = f"{r['step_ratio_vs_float32_held']:>8.3f}" if "step_ratio_vs_float32_held" in r else f"{'-':>8}"
        lines.append(
            f"{r['config']:<16}{1e3 * r['step_median_s']:>10.1f}{r['step_ratio_vs_fp32']:>9.3f}{vs_s}{held}"
            f"{r['compile_median_s']:>12.2f}{r['compile_ratio_vs_fp32']:>9.3f}{vs_c}{ok_s}{ok_c}"
        )
    if "fp32_vs_gspmd" in out:
        g = out["fp32_vs_gspmd"]
        lines.append(
            f"fp32 FSDP / plain GSPMD: step time {g['step_ratio']:.3f}x, compile time {g['compile_ratio']:.3f}x"
        )
    lines.append(
        f"targets: step ratio <= {out['targets']['step_ratio']}, compile ratio <= {out['targets']['compile_ratio']}; "
        "x held: code-held weights over the same config held as float32"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
