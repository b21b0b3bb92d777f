"""Convergence of QSDP against fp32 FSDP on Shakespeare, through the real sharded path.

    python -m experiments.convergence [--steps 1000] [--devices 8] [--out experiments/results]

Trains one GPT under: fp32 FSDP (3 seeds: the seed-to-seed spread), bf16 communication, QSDP
W8G8 / W6G6 / W4G4 (weights on the randomly shifted grid, the paper's method), QSDP W8G8 and
W4G4 with stochastic weight rounding, QSDP W8 weights with fp32 gradients (to separate the two
quantizers' effects), QSDP W8G8 with 256-element buckets (4x more scales), and the ``"comm"`` weight mode (ZeRO++-style: quantize only for the
all-gather) at 8 and 4 bits. Every quantized run uses the first fp32 run's seed (same initial
weights, same data order), so each gap is a paired comparison.

Resumable per run: each finished run is written to ``<out>/convergence_runs/<name>.json`` and
skipped next time. At the end it writes ``<out>/convergence.json`` (one record per run: config,
final validation loss, gap to the paired fp32 run and to the fp32 mean, wire bytes per step,
steps, wall time) and ``<out>/convergence.png`` (validation loss against step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.devices import simulate_cpu_devices

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def runs(seed: int = 0) -> list[tuple[str, dict]]:
    """(name, QSDPConfig kwargs and run seed) in the order they are trained."""
    fp = dict(weight_bits=None, grad_bits=None, weight_mode="full")
    return [
        ("fp32-seed0", dict(fp, seed=seed)),
        ("qsdp-W8G8", dict(weight_bits=8, grad_bits=8, seed=seed)),
        ("qsdp-W6G6", dict(weight_bits=6, grad_bits=6, seed=seed)),
        ("qsdp-W4G4", dict(weight_bits=4, grad_bits=4, seed=seed)),
        ("comm-W8G8", dict(weight_mode="comm", weight_bits=8, grad_bits=8, seed=seed)),
        ("comm-W4G4", dict(weight_mode="comm", weight_bits=4, grad_bits=4, seed=seed)),
        ("bf16", dict(fp, fp_comm_dtype="bfloat16", seed=seed)),
        ("fp32-seed1", dict(fp, seed=seed + 1)),
        ("fp32-seed2", dict(fp, seed=seed + 2)),
        ("qsdp-sr-W4G4", dict(weight_bits=4, grad_bits=4, weight_rounding="stochastic", seed=seed)),
        ("qsdp-sr-W8G8", dict(weight_bits=8, grad_bits=8, weight_rounding="stochastic", seed=seed)),
        ("qsdp-W8GF32", dict(weight_bits=8, grad_bits=None, seed=seed)),
        ("qsdp-W8G8-b256", dict(weight_bits=8, grad_bits=8, bucket_size=256, seed=seed)),
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="names of runs to do (default: all)")
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: Shakespeare)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)
    import qsdp_jax as q  # after XLA_FLAGS
    from experiments.trainer import RunConfig, train

    run_dir = args.out / "convergence_runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    todo = runs()
    if args.only:
        unknown = set(args.only) - {n for n, _ in todo}
        if unknown:
            print(f"unknown runs {sorted(unknown)}; known: {[n for n, _ in todo]}", file=sys.stderr)
            return 2
        todo = [r for r in todo if r[0] in args.only]
    for name, kw in todo:
        path = run_dir / f"{name}.json"
        if path.exists():
            print(f"[{name}] done already ({path})", flush=True)
            continue
        cfg = q.QSDPConfig(**kw)
        run = RunConfig(
            qsdp=cfg, preset=args.preset, steps=args.steps, batch_size=args.batch,
            seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=kw["seed"],
            eval_every=args.eval_every, eval_batches=args.eval_batches, data_path=args.data,
        )
        print(f"[{name}] training {args.steps} steps ...", flush=True)

        def on_step(log, name=name):
            if log.val_loss is not None:
                print(f"[{name}] step {log.step} loss {log.loss:.4f} val {log.val_loss:.4f}", flush=True)

        result = train(run, on_step=on_step)
        record = result.as_dict()
        record["name"] = name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
        print(f"[{name}] val {result.val_loss:.4f} in {result.wall_s:.0f} s", flush=True)
    summary = summarise(run_dir, [n for n, _ in runs()])
    if summary is None:
        print("not all runs are done yet; run again to continue", flush=True)
        return 0
    (args.out / "convergence.json").write_text(json.dumps(summary, indent=1))
    plot(run_dir, [n for n, _ in runs()], args.out / "convergence.png")
    print(table(summary))
    return 0


def summarise(run_dir: Path, names: list[str]) -> dict | None:
    records = {}
    for n in names:
        p = run_dir / f"{n}.json"
        if not p.exists():
            return None
        records[n] = json.loads(p.read_text())
    fp = [records[n]["val_loss"] for n in names if n.startswith("fp32")]
    fp_mean = sum(fp) / len(fp)
    spread = max(fp) - min(fp)
    paired = records["fp32-seed0"]["val_loss"]
    fp32_bytes = records["fp32-seed0"]["wire_bytes_per_step"]
    rows = []
    for n in names:
        r = records[n]
        rows.append({
            "name": n,
            "config": r["config"],
            "val_loss": r["val_loss"],
            "train_loss": r["train_loss"],
            "gap_to_paired_fp32": (r["val_loss"] - paired) / paired,
            "gap_to_fp32_mean": (r["val_loss"] - fp_mean) / fp_mean,
            "inside_fp32_spread": min(fp) <= r["val_loss"] <= max(fp),
            "wire_bytes_per_step": r["wire_bytes_per_step"],
            "bytes_ratio_vs_fp32": fp32_bytes / r["wire_bytes_per_step"],
            "steps": r["config"]["steps"],
            "wall_s": r["wall_s"],
            "tokens_per_s": r["tokens_per_s"],
            "nonfinite_steps": r["nonfinite_steps"],
        })
    return {
        "fp32_mean_val_loss": fp_mean,
        "fp32_spread": spread,
        "fp32_spread_relative": spread / fp_mean,
        "n_params": records["fp32-seed0"]["n_params"],
        "n_devices": records["fp32-seed0"]["n_devices"],
        "runs": rows,
    }


def table(summary: dict) -> str:
    lines = [
        f"fp32 mean val loss {summary['fp32_mean_val_loss']:.4f}, seed spread "
        f"{summary['fp32_spread']:.4f} ({100 * summary['fp32_spread_relative']:.2f}%)",
        f"{'run':<14}{'val loss':>10}{'vs paired fp32':>16}{'vs fp32 mean':>14}{'in spread':>11}"
        f"{'bytes/step':>13}{'x fewer':>9}",
    ]
    for r in summary["runs"]:
        lines.append(
            f"{r['name']:<14}{r['val_loss']:>10.4f}{100 * r['gap_to_paired_fp32']:>+15.2f}%"
            f"{100 * r['gap_to_fp32_mean']:>+13.2f}%{'yes' if r['inside_fp32_spread'] else 'no':>11}"
            f"{r['wire_bytes_per_step'] / 1e6:>11.2f}MB{r['bytes_ratio_vs_fp32']:>9.2f}"
        )
    return "\n".join(lines)


def plot(run_dir: Path, names: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for n in names:
        r = json.loads((run_dir / f"{n}.json").read_text())
        pts = [(h["step"], h["val_loss"]) for h in r["history"] if h["val_loss"] is not None]
        style = "-" if n.startswith(("fp32", "bf16")) else "--"
        ax.plot(*zip(*pts), style, label=n, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("QSDP vs FSDP: GPT on Shakespeare, 8 simulated devices")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
