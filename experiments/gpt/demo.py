"""``make demo``: QSDP W8G8 against fp32 FSDP, same tiny GPT, same seed, on Shakespeare.

    python -m experiments.gpt.demo [--steps 400] [--out runs/demo]

Trains the ``tiny`` GPT twice through the real sharded train step on the devices JAX finds (the
GPUs or TPUs of this host; on a machine with only a CPU, 8 simulated CPU devices),
first as plain FSDP with fp32 collectives, then as QSDP W8G8 (weights kept on a randomly
shifted 8-bit grid, 8-bit stochastically rounded gradients), with the same seed (same initial
weights, same batches), and prints one comparison table. Each run's files (see
``experiments.gpt.train``) go to ``<out>/fp32`` and ``<out>/qsdp-sr-W8G8``; the comparison to
``<out>/comparison.json``. Re-running replaces the demo's previous output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.gpt.args import RUNS_DIR, CLIError, parse_args
from experiments.gpt.train import run_cli
from experiments.gpt.devices import use_available_devices

DEFAULT_OUT = RUNS_DIR / "demo"
DEVICES = 8  # simulated CPU devices when there is nothing but a CPU
BATCH = 16

HEADER = """\
QSDP demo: the same tiny byte-level GPT ({n_params}) trained {steps} steps on Shakespeare,
same seed, as (1) FSDP with fp32 collectives and (2) QSDP W8G8: weights kept on a randomly
shifted 8-bit grid (lossless 8-bit all-gather) and 8-bit stochastically rounded gradients
(reduce-scatter), on {devices}.
Wire bytes are exact (read from the compiled step).{cpu_note}"""

CPU_NOTE = """ The devices are simulated on this machine's CPU: tokens/s measures compute on one CPU, not a
network, so its ratio is not the speed-up quantization would give on real interconnects."""


def _bytes(x: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def comparison(fp32: dict, qsdp: dict) -> dict:
    """The numbers the table shows, from two ``summary.json`` dicts."""
    return {
        "val_loss_gap_relative": (qsdp["val_loss"] - fp32["val_loss"]) / fp32["val_loss"],
        "train_loss_gap_relative": (qsdp["train_loss"] - fp32["train_loss"]) / fp32["train_loss"],
        "bytes_ratio_fp32_over_qsdp": fp32["wire_bytes_per_step"] / qsdp["wire_bytes_per_step"],
        "tokens_per_s_ratio_qsdp_over_fp32": qsdp["tokens_per_s"] / fp32["tokens_per_s"],
    }


def comparison_table(fp32: dict, qsdp: dict) -> str:
    """One text table comparing two runs' summaries (``summary.json`` of each)."""
    c = comparison(fp32, qsdp)
    q_name = qsdp.get("name", "QSDP")
    rows = [
        (
            "validation loss",
            f"{fp32['val_loss']:.4f}",
            f"{qsdp['val_loss']:.4f}",
            f"{100 * c['val_loss_gap_relative']:+.2f}%",
        ),
        (
            "train loss",
            f"{fp32['train_loss']:.4f}",
            f"{qsdp['train_loss']:.4f}",
            f"{100 * c['train_loss_gap_relative']:+.2f}%",
        ),
        (
            "wire bytes / step / device",
            _bytes(fp32["wire_bytes_per_step"]),
            _bytes(qsdp["wire_bytes_per_step"]),
            f"{c['bytes_ratio_fp32_over_qsdp']:.2f}x fewer",
        ),
        (
            "tokens/s (simulated, CPU)" if "simulated" in fp32.get("devices", "simulated") else "tokens/s",
            f"{fp32['tokens_per_s']:,.0f}",
            f"{qsdp['tokens_per_s']:,.0f}",
            f"{c['tokens_per_s_ratio_qsdp_over_fp32']:.2f}x",
        ),
    ]
    header = ("", "fp32 FSDP", q_name, f"{q_name} vs fp32")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]

    def line(r):
        return "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))

    sep = "-" * len(line(header))
    return "\n".join([line(header), sep, *(line(r) for r in rows), sep])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpt.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="training steps per run (default: 400)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    use_available_devices(DEVICES)
    import jax

    n = jax.device_count()
    batch = BATCH if BATCH % n == 0 else n * -(-BATCH // n)  # a multiple of the device count
    common = [
        "--preset",
        "tiny",
        "--steps",
        str(args.steps),
        "--batch",
        str(batch),
        "--seed",
        "0",
        "--eval-every",
        str(max(1, args.steps // 4)),
        "--eval-batches",
        "16",
        "--overwrite",
        "--no-fp32-ratio",
    ]
    runs = [("fp32", ["--fp32"]), ("qsdp-sr-W8G8", ["--weight-bits", "8", "--grad-bits", "8"])]
    summaries = {}
    for i, (name, flags) in enumerate(runs):
        cli = parse_args([*common, *flags, "--out", str(args.out / name)])
        print(f"[{i + 1}/{len(runs)}] {name}: training {args.steps} steps ...", file=sys.stderr, flush=True)
        try:
            run_cli(cli, print_summary=False)
        except CLIError as e:
            print(f"demo: {e}", file=sys.stderr)
            return 2
        summaries[name] = json.loads((args.out / name / "summary.json").read_text())

    fp32, qsdp = summaries["fp32"], summaries["qsdp-sr-W8G8"]
    table = comparison_table(fp32, qsdp)
    wall = time.perf_counter() - t0
    print()
    devices = fp32.get("devices", f"{fp32['n_devices']} devices")
    print(
        HEADER.format(
            n_params=f"{fp32['n_params'] / 1e6:.2f}M params",
            steps=args.steps,
            devices=devices,
            cpu_note=CPU_NOTE if "simulated" in devices else "",
        )
    )
    print()
    print(table)
    print(
        f"\nboth runs in {wall:.0f} s; per-run files (metrics.jsonl, loss.png, ...) in "
        f"{args.out}/fp32 and {args.out}/qsdp-sr-W8G8"
    )
    record = {"fp32": fp32, "qsdp": qsdp, **comparison(fp32, qsdp), "table": table, "wall_s": wall}
    (args.out / "comparison.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
