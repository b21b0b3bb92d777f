"""Two-level (hierarchical) QSDP over a shaped network: 2 processes x 4 devices, ("node", "local").

    python -m experiments.bench.twolevel                      # 100 Mbit/s and unshaped
    python -m experiments.bench.twolevel --bandwidths 100 --repeats 5

The harness of ``experiments.bench.network`` (shaped network namespace, jax.distributed + gloo
workers, alternating timing, per-call max over processes) with a ``("node", "local")`` mesh
where each process is one node holding ``--devices-per-process`` simulated devices, so the
``node`` axis is the one that crosses processes (and the shaped loopback). Configs
(``experiments.shelf.twolevel_workload.TWO_LEVEL_CONFIGS``), all two-stage on the same mesh:

* ``fp32``: fp32 FSDP, weights gathered and gradients reduce-scattered in two stages;
* ``qsdp-W8G8``: 8-bit on both levels;
* ``qsdp-W8G8-xG4``: 8-bit weights, 8-bit gradients inside a node, 4-bit across;
* ``qsdp-W4G8-xG4``: 4-bit weights (one grid: 4 bits on both levels), 8-bit gradients inside,
  4-bit across: every byte that crosses nodes is 4-bit.

Besides the step times, the JSON holds each compiled step's wire bytes per mesh axis
(``bytes_by_axis``: ``node``, ``local``, ``node+local`` for groups over all devices) and the
targets: ``qsdp-W4G8-xG4`` >= 3.5x faster per step than ``fp32`` at the lowest shaped bandwidth,
and its inter-node bytes (``node`` + ``node+local``) <= 1/7 of fp32's. Output: a table and
``experiments/results/network_twolevel.json`` (``--out``). Needs root and iproute2 (see
``experiments.bench.network``); without them it says so and exits 0 without measuring.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.shelf import multiproc, netns  # as modules, like experiments.bench.network
from experiments.shelf.network_results import (
    assemble_results,
    bw_label,
    clean_floats,
    format_table,
    parse_bandwidth,
    write_json,
)
from experiments.shelf.network_workload import DEFAULT_MODEL

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "network_twolevel.json"
WORKLOAD = "experiments.shelf.twolevel_workload"
TARGET_CONFIG = "qsdp-W4G8-xG4"
TARGET_SPEEDUP = 3.5
TARGET_INTER_BYTES_RATIO = 1 / 7


def inter_node_bytes(by_axis: Mapping[str, float]) -> float:
    """Bytes per device per step whose replica groups cross nodes."""
    return sum(v for k, v in by_axis.items() if "node" in k.split("+"))


def evaluate(doc: Mapping[str, Any], axis_bytes: Mapping[str, Mapping[str, float]]) -> dict:
    """The two targets (speedup at the lowest shaped bandwidth, inter-node bytes ratio)."""
    shaped = [b for b in doc["bandwidths"] if b["bandwidth_mbit"] is not None and "configs" in b]
    out: dict[str, Any] = {"config": TARGET_CONFIG}
    fp32_inter = inter_node_bytes(axis_bytes.get("fp32", {}))
    got_inter = inter_node_bytes(axis_bytes.get(TARGET_CONFIG, {}))
    ratio = got_inter / fp32_inter if fp32_inter else None
    out["inter_node_bytes"] = {
        "fp32": fp32_inter,
        TARGET_CONFIG: got_inter,
        "ratio": ratio,
        "required_ratio_at_most": TARGET_INTER_BYTES_RATIO,
        "met": None if ratio is None else ratio <= TARGET_INTER_BYTES_RATIO,
    }
    if shaped:
        low = min(shaped, key=lambda b: b["bandwidth_mbit"])
        speedup = low["configs"].get(TARGET_CONFIG, {}).get("speedup_vs_fp32")
        out["speedup"] = {
            "bandwidth_mbit": low["bandwidth_mbit"],
            "speedup_vs_fp32": speedup,
            "required": TARGET_SPEEDUP,
            "met": None if speedup is None else speedup >= TARGET_SPEEDUP,
        }
    return out


def axis_table(axis_bytes: Mapping[str, Mapping[str, float]]) -> str:
    """config x axis: MB per device per step, and inter-node bytes relative to fp32."""
    axes = sorted({a for v in axis_bytes.values() for a in v})
    base = inter_node_bytes(axis_bytes.get("fp32", {})) or None
    lines = [f"{'config':<15}" + "".join(f"{a + ' [MB]':>16}" for a in axes) + f"{'inter-node vs fp32':>20}"]
    for name, v in axis_bytes.items():
        rel = inter_node_bytes(v) / base if base else float("nan")
        lines.append(f"{name:<15}" + "".join(f"{v.get(a, 0) / 1e6:16.3f}" for a in axes) + f"{rel:20.3f}")
    return "\n".join(lines)


def step_table(doc: Mapping[str, Any], axis_bytes: Mapping[str, Mapping[str, float]], devices_per_process: int) -> str:
    """bandwidth x config: step time, speedup over fp32, inter-node MB per process per step and
    the ideal time to send them over one direction of a host's link at that rate."""
    head = (
        f"{'bandwidth':<12} {'config':<15} {'step [s]':>9} {'IQR [s]':>8} {'n':>3} "
        f"{'vs fp32':>8} {'inter-node MB':>14} {'ideal inter [s]':>16}"
    )
    lines = [head, "-" * len(head)]
    for b in doc["bandwidths"]:
        label = bw_label(b["bandwidth_mbit"])
        if "error" in b:
            lines.append(f"{label:<12} FAILED: {b['error'].splitlines()[0][:100]}")
            continue
        for name, c in b["configs"].items():
            inter = inter_node_bytes(axis_bytes.get(name, {})) * devices_per_process
            ideal = "-" if b["bandwidth_mbit"] is None else f"{inter * 8 / (b['bandwidth_mbit'] * 1e6):.3f}"
            sp = c.get("speedup_vs_fp32")
            lines.append(
                f"{label:<12} {name:<15} {c['median_s']:9.3f} {c['iqr_s']:8.3f} {c['n']:>3} "
                f"{'-' if sp is None else f'{sp:.2f}x':>8} {inter / 1e6:14.2f} {ideal:>16}"
            )
            label = ""
    return "\n".join(lines)


def _measure(bw, args, kwargs) -> dict[str, Any]:
    t0 = time.perf_counter()
    if args.no_netns:
        procs = multiproc.run_processes(
            WORKLOAD,
            "twolevel_benchmark",
            args.num_processes,
            kwargs,
            devices_per_process=args.devices_per_process,
            timeout_s=args.timeout,
        )
        return {"bandwidth_mbit": None, "netns": None, "processes": procs, "wall_s": time.perf_counter() - t0}
    names: str | list[str]  # the one shaped namespace, or one per process
    if args.link == "loopback":  # bench.network's setup: every byte through one shaped queue
        with netns.shaped_namespace(name_prefix="qsdp2lvl", rate_mbit=bw, mtu=args.mtu, burst_kb=args.burst_kb) as ns:
            procs = multiproc.run_processes(
                WORKLOAD,
                "twolevel_benchmark",
                args.num_processes,
                kwargs,
                devices_per_process=args.devices_per_process,
                netns=ns,
                timeout_s=args.timeout,
            )
            names = ns.name
    else:  # one namespace per process: only inter-process (inter-node) traffic is shaped
        addrs = [netns.HOST_ADDR.format(i + 1) for i in range(args.num_processes)]
        env = {"QSDP_COORDINATOR_HOST": addrs[0], "QSDP_GLOO_HOSTS": ",".join(addrs)}
        with netns.veth_namespaces(
            args.num_processes, rate_mbit=bw, name_prefix="qsdp2lvl", mtu=args.mtu, burst_kb=args.burst_kb
        ) as hosts:
            procs = multiproc.run_processes(
                WORKLOAD,
                "twolevel_benchmark",
                args.num_processes,
                kwargs,
                devices_per_process=args.devices_per_process,
                netns=hosts,
                timeout_s=args.timeout,
                extra_env=env,
            )
            names = [h.name for h in hosts]
    return {"bandwidth_mbit": bw, "netns": names, "processes": procs, "wall_s": time.perf_counter() - t0}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.twolevel",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--bandwidths", nargs="+", default=["100", "none"])
    p.add_argument("--no-netns", action="store_true", help="unshaped only, no namespace")
    p.add_argument(
        "--link",
        choices=["veth", "loopback"],
        default="veth",
        help="veth: one namespace per process, only inter-process traffic shaped "
        "(each direction of each host's link at the rate); loopback: "
        "bench.network's single shaped loopback (all traffic, all directions)",
    )
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--d-model", type=int, default=DEFAULT_MODEL["d_model"])
    p.add_argument("--n-layers", type=int, default=DEFAULT_MODEL["n_layers"])
    p.add_argument("--batch-per-process", type=int, default=8)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--burst-kb", type=float, default=512)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bws = list(dict.fromkeys(parse_bandwidth(b) for b in args.bandwidths))
    if args.no_netns:
        bws = [None]
    else:
        reason = netns.check_netns_support()
        if reason is not None:
            print(f"bench.twolevel: shaped namespaces unavailable ({reason}); nothing measured", file=sys.stderr)
            return 0
    model = dict(DEFAULT_MODEL, d_model=args.d_model, n_layers=args.n_layers)
    kwargs = dict(model=model, batch_per_process=args.batch_per_process, repeats=args.repeats, warmup=args.warmup)
    measurements, failed, t0 = [], False, time.perf_counter()
    for bw in bws:
        print(f"[bench.twolevel] {bw_label(bw)}: starting...", flush=True)
        try:
            measurements.append(_measure(bw, args, kwargs))
        except Exception as e:  # noqa: BLE001 - record and go on
            failed = True
            print(f"[bench.twolevel] {bw_label(bw)} FAILED:\n{e}", file=sys.stderr, flush=True)
            measurements.append({"bandwidth_mbit": bw, "error": f"{type(e).__name__}: {e}"})
    ok = [m for m in measurements if "processes" in m]
    axis_bytes = {n: c["bytes_by_axis"] for n, c in ok[0]["processes"][0]["configs"].items()} if ok else {}
    meta = {
        "benchmark": "qsdp_jax two-level network speedup (experiments.bench.twolevel)",
        "command": " ".join(["python -m experiments.bench.twolevel", *(argv if argv is not None else sys.argv[1:])]),
        "mesh": ok[0]["processes"][0]["mesh"] if ok else None,
        "devices_per_process": args.devices_per_process,
        "link": "none" if args.no_netns else args.link,
        "configs_spec": ({n: c["spec"] for n, c in ok[0]["processes"][0]["configs"].items()} if ok else {}),
        "bytes_by_axis": axis_bytes,
        "wall_s": time.perf_counter() - t0,
        "loadavg_end": list(os.getloadavg()),
    }
    doc = assemble_results(measurements, meta)
    doc.pop("targets", None)  # bench.network's 1-D targets do not apply here
    doc["twolevel_targets"] = evaluate(doc, axis_bytes)
    doc = clean_floats(doc)
    print()
    if args.link == "loopback" or args.no_netns:
        print(format_table(doc))
    else:
        print(step_table(doc, axis_bytes, args.devices_per_process))
        print(
            "inter-node MB: bytes one process sends to the other per step (node-axis "
            "collectives, HLO); each host link is shaped per direction at the rate."
        )
    print()
    print("wire bytes per device per step, by the mesh axes each collective spans:")
    print(axis_table(axis_bytes))
    print()
    print("targets:", doc["twolevel_targets"])
    write_json(args.out, doc)
    print(f"\nwrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
