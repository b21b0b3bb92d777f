"""Average wire bits per element of runbook configurations, from their compiled GPT step.

One compile per configuration, no training: ``32 * wire bytes / fp32 FSDP wire bytes`` (the
definition of ``experiments.convergence.frontier``), with the HLO-vs-formula check of
``experiments.shelf.wire_bytes``.

    python -m experiments.convergence.frontier_bits --preset small --group frontier
"""

from __future__ import annotations

import argparse
import json
import sys

from experiments.convergence.runbook import CONFIGS
from experiments.gpt.devices import simulate_cpu_devices
from experiments.shelf import wire_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--group", default="frontier", help="runbook group (default: frontier)")
    p.add_argument("--only", nargs="*", default=None, help="runbook configuration names instead")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--out", default=None, help="write the JSON record here")
    a = p.parse_args(argv)
    simulate_cpu_devices(a.devices)
    import qsdp_jax as q  # after the device count is set

    names = a.only or [n for n, s in CONFIGS.items() if s.group == a.group]
    cfgs = [q.QSDPConfig(**CONFIGS[n].qsdp) for n in names]
    measure = lambda c: wire_bytes.measure(a.preset, [c], n_devices=a.devices, batch_size=16)  # noqa: E731
    fp32 = measure(q.QSDPConfig.fp32())["schemes"]["fp32"]["total_bytes"]
    rows = {}
    for n, c in zip(names, cfgs):  # one call each: config names do not carry the bucket size
        r = measure(c)["schemes"][c.name]
        rows[n] = {
            "config": c.name,
            "bucket_size": c.bucket_size,
            "total_bytes": r["total_bytes"],
            "wire_bits_per_element": 32 * r["total_bytes"] / fp32,
            "formula_rel_diff": r["formula_rel_diff"],
        }
        print(
            f"| {n} | {rows[n]['wire_bits_per_element']:.3f} | {r['total_bytes'] / 1e6:.3f} MB | "
            f"{r['formula_rel_diff']:+.4f} |",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"preset": a.preset, "fp32_total_bytes": fp32, "configs": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
