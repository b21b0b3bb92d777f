"""Bytes on the wire per device per step of the compiled GPT train step, by scheme.

    python -m experiments.bench.comm [--devices 8] [--presets tiny small medium]
                                     [--bucket 1024] [--batch 16] [--out experiments/results]

For every GPT preset and every scheme (fp32 FSDP, bf16 FSDP, QSDP W8G8 / W6G6 / W4G4 / W4G8 /
W2G4) the train step is *compiled, not run*, from an abstract state, so the GPT-2 shapes
(``gpt-125m`` ...) work too, and its wire bytes per device per step are read from the optimized
HLO next to the analytic formula (:mod:`experiments.shelf.wire_bytes` says how both are counted).
The small replicated leaves' all-reduce, which the formula leaves out, is reported in its own
column.

Writes ``<out>/comm_bytes.json`` (everything printed, machine-readable, with the command).

Note: on XLA:CPU the bf16 collectives appear as ``u16`` in the HLO. That is deliberate:
``qsdp_jax.collectives`` bitcasts bf16 to uint16 for the wire, because XLA's CPU backend would
otherwise widen bf16 collectives to f32 and move twice the bytes the bf16 baseline claims.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from experiments.gpt.devices import simulate_cpu_devices
from experiments.shelf.wire_bytes import DEFAULT_SCHEMES, measure, scheme_config

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"
DEFAULT_PRESETS = ("tiny", "small", "medium")
BF16_NOTE = (
    "On XLA:CPU the bf16 collectives are sent as uint16 (u16 in the HLO): qsdp_jax bitcasts "
    "bf16 to uint16 for the wire on purpose, because XLA's CPU backend would otherwise widen "
    "bf16 collectives to f32 (twice the bytes the bf16 baseline claims)."
)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------
def table(results: Sequence[dict]) -> str:
    """Rows preset x scheme: MB/step, the split by kind, formula, ratios (MB = 1e6 bytes)."""
    head = (
        f"{'preset':<9}{'scheme':<11}{'MB/step':>10}{'all-gath':>10}{'all-to-all':>11}"
        f"{'red-scat':>10}{'all-red':>9}{'formula':>10}{'HLO-form':>9}{'vs fp32':>9}{'vs bf16':>9}"
    )
    lines = [head, "-" * len(head)]
    for res in results:
        for name, r in res["schemes"].items():
            k = r["by_kind"]
            ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
            lines.append(
                f"{res['preset']:<9}{name:<11}{r['total_bytes'] / 1e6:>10.3f}"
                f"{k['all-gather'] / 1e6:>10.3f}{k['all-to-all'] / 1e6:>11.3f}"
                f"{k['reduce-scatter'] / 1e6:>10.3f}{k['all-reduce'] / 1e6:>9.3f}"
                f"{r['formula_bytes']['total'] / 1e6:>10.3f}{100 * r['formula_rel_diff']:>+8.3f}%"
                f"{ratio(r['ratio_vs_fp32']):>9}{ratio(r['ratio_vs_bf16']):>9}"
            )
        lines.append("")
    lines += [
        "MB = 1e6 bytes sent per device per step (ring model, (N-1)/N). 'formula' = analytic "
        "n*bits/8 + 8 B/bucket over gathers and scatters",
        "(no all-reduce); 'HLO-form' = (HLO all-gather + all-to-all + reduce-scatter - formula) "
        "/ formula. Ratios use the total.",
        "Note: " + BF16_NOTE,
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    simulate_cpu_devices(args.devices)
    import jax  # noqa: F401  (after XLA_FLAGS)

    for s in args.schemes:
        scheme_config(s, args.bucket)  # fail fast on a bad name
    t0 = time.perf_counter()
    results = []
    for preset in args.presets:
        results.append(
            measure(
                preset, args.schemes, n_devices=args.devices, bucket=args.bucket, batch_size=args.batch, verbose=True
            )
        )
    wall = time.perf_counter() - t0
    record = {
        "command": " ".join(["python -m experiments.bench.comm", *map(shlex.quote, raw)]),
        "what": "wire bytes per device per step of the compiled (not run) GPT train step, "
        "from qsdp_jax.comm.comm_report (ring model)",
        "n_devices": args.devices,
        "bucket_size": args.bucket,
        "batch_sequences": args.batch,
        "jax_backend": jax.default_backend(),
        "notes": [
            BF16_NOTE,
            "formula_bytes = sum over gathers and scatters of elements * (bits/8 + 8/bucket) "
            "(quantized) or elements * 4 / 2 (fp32 / bf16), times (N-1)/N; the all-reduce of "
            "replicated leaves is not in the formula.",
        ],
        "wall_s": wall,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "comm_bytes.json"
    path.write_text(json.dumps(record, indent=1))
    print()
    print(table(results))
    print(f"\nwrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
