"""Wall-clock speedup of QSDP over FSDP across 2 JAX processes over a real, shaped network.

    python -m experiments.bench.network                       # 100 Mbit/s, 1 Gbit/s, unshaped
    python -m experiments.bench.network --bandwidths 100 none --repeats 5
    python -m experiments.bench.network --no-netns            # unshaped only, no root needed

For each bandwidth a fresh network namespace is created whose loopback is shaped with a token
bucket filter (``tbf``; MTU 9000, burst 512 KiB, see ``experiments.shelf.netns``), or left unshaped
(``none``).  Two JAX processes (``experiments.shelf.multiproc.run_processes``: jax.distributed +
gloo over 127.0.0.1 of that namespace, 1 simulated CPU device each unless
``--devices-per-process``) build the same GPT and compile the train step of fp32 FSDP, bf16
FSDP, QSDP W8G8 and QSDP W4G4 (``experiments.shelf.network_workload``).  All four are timed
*alternately* in the same processes (``experiments.shelf.timing.time_alternating``: warm-up
excluded, medians), so the ratios compare like with like.

A step's time is the per-call maximum over the processes (the slower process defines the step;
the collectives keep them in lock-step, so the two differ little).  Bytes per step are read
from the compiled step in the worker (``qsdp_jax.comm.comm_report``, wire bytes one device
sends, times the devices of a process).

IMPORTANT: all processes share the namespace's one loopback queue, so the shaped rate is the
*total* rate of all traffic in all directions: with P processes each sending B bytes per step
the shaper carries P * B bytes per step (the ``shaper_bytes_per_step`` / ``ideal_comm_s``
columns of the JSON).

Model (default): GPT with d_model 256, 4 layers, 4 heads, seq 64, byte vocabulary, batch 4
per process (~3.2M parameters); fp32 FSDP sends ~19 MB per process per step (two all-gathers
of the weights - forward and rematerialised backward - and one reduce-scatter of the
gradients), i.e. ~39 MB through the shaper: ~3 s per step at 100 Mbit/s against a compute-only
step of a few hundred ms, so fp32 FSDP spends most of its step communicating there, as in the
paper's multi-node setting.

Output: a table on stdout and ``experiments/results/network.json`` (``--out``) with, per
bandwidth and config, the median / min / IQR / samples of the step time, speedups over fp32
and bf16, bytes per step, and a flat ``runs`` list::

    {"runs": [{"config": "fp32"|"bf16"|"qsdp-W8G8"|"qsdp-W4G4",
               "bandwidth_mbit": 100|1000|null, "step_time_s": float,
               "bytes_per_step": float (per process), "n_processes": 2, ...}, ...]}

Exit status: 0 on success; 0 with a message on stderr (nothing measured, no JSON written) when
shaped namespaces are unavailable here (not root, no ``ip``/``tc``, restricted container) and
``--no-netns`` was not given; 1 if any bandwidth's run failed (the others are still written);
130 on Ctrl-C.  Namespaces are always removed (also on failure / Ctrl-C / SIGTERM), after the
worker processes are dead.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.shelf import multiproc, netns  # as modules: tests replace their functions
from experiments.shelf.network_results import (
    assemble_results,
    bw_label,
    clean_floats,
    format_table,
    parse_bandwidth,
    write_json,
)
from experiments.shelf.network_workload import CONFIG_NAMES, DEFAULT_MODEL

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_NETNS_UNAVAILABLE", "DEFAULT_BANDWIDTHS", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
#: Exit status when namespaces are unavailable (documented: a clean exit, nothing measured).
EXIT_NETNS_UNAVAILABLE = 0

DEFAULT_BANDWIDTHS = ("100", "1000", "none")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "network.json"
WORKLOAD = "experiments.shelf.network_workload"
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.network",
        description=__doc__.split("\n")[0],
        epilog=(
            "Needs root and iproute2 (ip, tc) for the shaped namespaces; without them it says "
            "why and exits with status 0 without measuring (use --no-netns for the unshaped "
            "measurement only). Status 1: a run failed; 130: interrupted."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--bandwidths",
        nargs="+",
        default=list(DEFAULT_BANDWIDTHS),
        help="Mbit/s of the shaped loopback (total for all traffic), or 'none'",
    )
    p.add_argument(
        "--no-netns", action="store_true", help="no namespace: only the unshaped measurement, on the host loopback"
    )
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=1)
    p.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES))
    p.add_argument("--repeats", type=int, default=7, help="timed steps per config")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per config (after compile)")
    p.add_argument("--d-model", type=int, default=DEFAULT_MODEL["d_model"])
    p.add_argument("--n-layers", type=int, default=DEFAULT_MODEL["n_layers"])
    p.add_argument("--n-heads", type=int, default=DEFAULT_MODEL["n_heads"])
    p.add_argument("--seq-len", type=int, default=DEFAULT_MODEL["seq_len"])
    p.add_argument("--batch-per-process", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--burst-kb", type=float, default=512)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per bandwidth run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="compile with XLA backend optimisation level 0 (smoke tests only: "
        "slower steps, not representative timings)",
    )
    return p


def _measure(bw, args, kwargs) -> dict[str, Any]:
    run = lambda ns: multiproc.run_processes(  # noqa: E731
        WORKLOAD,
        "network_benchmark",
        args.num_processes,
        kwargs,
        devices_per_process=args.devices_per_process,
        netns=ns,
        timeout_s=args.timeout,
    )
    t0 = time.perf_counter()
    if args.no_netns:
        procs = run(None)
        ns_name = None
    else:
        # run_processes kills and reaps its workers before returning or raising, so the
        # namespace is empty when shaped_namespace deletes it (on every exit path).
        with netns.shaped_namespace(name_prefix="qsdpbench", rate_mbit=bw, mtu=args.mtu, burst_kb=args.burst_kb) as ns:
            ns_name = ns.name
            procs = run(ns)
    return {"bandwidth_mbit": bw, "netns": ns_name, "processes": procs, "wall_s": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bws = []
    for t in args.bandwidths:
        try:
            bws.append(parse_bandwidth(t))
        except argparse.ArgumentTypeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.no_netns:
        dropped = [b for b in bws if b is not None]
        if dropped:
            print(f"--no-netns: skipping shaped bandwidths {dropped} (they need a namespace)", file=sys.stderr)
        bws = [None]
    else:
        reason = netns.check_netns_support()
        if reason is not None:
            print(
                "bench.network: shaped network namespaces are not available here:\n"
                f"  {reason}\n"
                "Nothing was measured (needs root and iproute2 'ip'/'tc'). Run as root, or use\n"
                "  python -m experiments.bench.network --no-netns\n"
                "for the unshaped measurement only.",
                file=sys.stderr,
            )
            return EXIT_NETNS_UNAVAILABLE
    seen = []
    for b in bws:
        if b not in seen:
            seen.append(b)
    bws = seen

    model = dict(
        d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq_len=args.seq_len, vocab_size=256
    )
    kwargs = dict(
        model=model,
        batch_per_process=args.batch_per_process,
        configs=args.configs,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        compiler_options=FAST_COMPILE if args.fast_compile else None,
    )
    meta = {
        "command": " ".join(["python -m experiments.bench.network", *(argv if argv is not None else sys.argv[1:])]),
        "n_processes": args.num_processes,
        "devices_per_process": args.devices_per_process,
        "netns": not args.no_netns,
        "mtu": None if args.no_netns else args.mtu,
        "burst_kb": None if args.no_netns else args.burst_kb,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "fast_compile": bool(args.fast_compile),
        "host": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
    }
    t_start = time.perf_counter()
    measurements: list[dict] = []
    failed = False
    try:
        for bw in bws:
            print(
                f"[bench.network] {bw_label(bw)}: starting {args.num_processes} processes "
                f"({'no namespace' if args.no_netns else 'in a network namespace'})...",
                flush=True,
            )
            try:
                m = _measure(bw, args, kwargs)
            except Exception as e:  # noqa: BLE001 - WorkerError, NetnsError: record, go on
                failed = True
                print(f"[bench.network] {bw_label(bw)} FAILED:\n{e}", file=sys.stderr, flush=True)
                measurements.append({"bandwidth_mbit": bw, "error": f"{type(e).__name__}: {e}"})
                continue
            measurements.append(m)
            cfgs = m["processes"][0]["configs"]
            print(
                f"[bench.network] {bw_label(bw)}: done in {m['wall_s']:.0f} s; medians "
                + ", ".join(f"{n} {c['median_s']:.3f}s" for n, c in cfgs.items()),
                flush=True,
            )
    except KeyboardInterrupt:
        print("\n[bench.network] interrupted; workers killed, namespaces removed", file=sys.stderr)
        return 130

    meta["wall_s"] = time.perf_counter() - t_start
    meta["host"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["run_wall_s"] = {str(m["bandwidth_mbit"]): m.get("wall_s") for m in measurements}
    doc = clean_floats(assemble_results(measurements, meta))
    print()
    print(format_table(doc))
    write_json(args.out, doc)
    print(f"\nwrote {args.out}  (total wall time {meta['wall_s']:.0f} s)")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
