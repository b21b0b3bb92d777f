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
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.shelf.timing import quantile

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_NETNS_UNAVAILABLE",
    "DEFAULT_BANDWIDTHS",
    "SHAPER_NOTE",
    "BURST_NOTE",
    "TARGETS",
    "parse_bandwidth",
    "combine_processes",
    "assemble_results",
    "format_table",
    "main",
]

EXIT_OK = 0
EXIT_FAILED = 1
#: Exit status when namespaces are unavailable (documented: a clean exit, nothing measured).
EXIT_NETNS_UNAVAILABLE = 0

DEFAULT_BANDWIDTHS = ("100", "1000", "none")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "network.json"
WORKLOAD = "experiments.shelf.network_workload"
FAST_COMPILE = {"xla_backend_optimization_level": 0}

SHAPER_NOTE = (
    "All processes share the namespace's single loopback egress queue (tbf), so the shaped "
    "rate is the TOTAL rate of all traffic of all processes in all directions, not a per-link "
    "rate: with P processes each sending B bytes per step the shaper carries P*B bytes per step "
    "(shaper_bytes_per_step; ideal_comm_s = shaper bytes * 8 / rate)."
)
BURST_NOTE = (
    "tbf banks tokens while the link is idle: each compute gap between collectives refills the "
    "bucket (up to burst_kb), which the next collective then sends at loopback speed. With "
    "gaps shorter than burst/rate (42 ms at 100 Mbit/s with 512 KiB) the shaped step behaves "
    "as if compute overlapped the transfer: step ~ max(comm, compute), not comm + compute. "
    "serial_est_s = ideal_comm_s + the unshaped step is the no-overlap estimate."
)

#: speedup over fp32 FSDP required at the lowest shaped bandwidth
TARGETS: dict[str, float] = {"qsdp-W8G8": 2.2, "qsdp-W4G4": 3.5}


# ------------------------------------------------------------------------------- assembly


def parse_bandwidth(text: str) -> int | float | None:
    """``"100"`` -> 100 (Mbit/s), ``"2.5"`` -> 2.5, ``"none"``/``"unshaped"`` -> None."""
    t = str(text).strip().lower()
    if t in ("none", "unshaped", "inf", "null"):
        return None
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bandwidth must be a number of Mbit/s or 'none', got {text!r}"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be > 0 Mbit/s, got {text!r}")
    return int(v) if v.is_integer() else v


def _stats(samples: Sequence[float]) -> dict[str, Any]:
    xs = sorted(samples)
    q1, q3 = quantile(xs, 0.25), quantile(xs, 0.75)
    return {
        "step_time_s": quantile(xs, 0.5),
        "median_s": quantile(xs, 0.5),
        "min_s": xs[0] if xs else math.nan,
        "max_s": xs[-1] if xs else math.nan,
        "q1_s": q1,
        "q3_s": q3,
        "iqr_s": q3 - q1,
        "n": len(xs),
    }


def combine_processes(per_process: Sequence[Mapping[str, Any]], config: str) -> dict[str, Any]:
    """One config's timing across processes: per-call max of the samples, then statistics.

    Every process makes the same calls in the same order (time_alternating is deterministic),
    so sample ``i`` of every process is the same step; the slower process defines it.
    """
    runs = [p["configs"][config] for p in per_process]
    n = min(len(r["samples_s"]) for r in runs)
    samples = [max(r["samples_s"][i] for r in runs) for i in range(n)]
    out = _stats(samples)
    out["samples_s"] = samples
    out["per_process_median_s"] = [r["median_s"] for r in runs]
    out["first_call_s"] = max((r.get("first_call_s") or 0.0) for r in runs)
    out["compile_s"] = max(r.get("compile_s", 0.0) for r in runs)
    r0 = runs[0]
    out["bytes_per_step"] = float(r0["bytes_per_process"])
    out["bytes_per_device"] = float(r0["bytes_per_device"])
    out["bytes_by_kind_dtype"] = r0.get("bytes_by_kind_dtype", {})
    out["final_loss"] = r0.get("final_loss")
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def assemble_results(
    measurements: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the JSON document from the worker results.

    Args:
      measurements: one entry per bandwidth, in order: ``{"bandwidth_mbit": int|float|None,
        "netns": str|None, "processes": [worker dict, ...]}`` (worker dicts as returned by
        ``network_workload.network_benchmark``), or ``{"bandwidth_mbit", "error": str}``
        for a run that failed.
      meta: extra top-level fields (model, command line, load...).
    """
    bandwidths = []
    runs = []
    model_info = None
    for m in measurements:
        bw = m["bandwidth_mbit"]
        entry: dict[str, Any] = {"bandwidth_mbit": bw, "netns": m.get("netns")}
        if "error" in m:
            entry["error"] = m["error"]
            bandwidths.append(entry)
            continue
        procs = list(m["processes"])
        n_proc = len(procs)
        p0 = procs[0]
        if model_info is None:
            model_info = {
                k: p0.get(k)
                for k in ("model", "n_params", "batch_per_process", "global_batch",
                          "device_count", "local_device_count", "process_count")
            }
        configs: dict[str, dict] = {}
        for name in p0["configs"]:
            c = combine_processes(procs, name)
            c["shaper_bytes_per_step"] = c["bytes_per_step"] * n_proc
            c["ideal_comm_s"] = (
                None if bw is None else c["shaper_bytes_per_step"] * 8 / (bw * 1e6)
            )
            configs[name] = c
        base32 = configs.get("fp32", {}).get("median_s")
        base16 = configs.get("bf16", {}).get("median_s")
        for name, c in configs.items():
            c["speedup_vs_fp32"] = _ratio(base32, c["median_s"])
            c["speedup_vs_bf16"] = _ratio(base16, c["median_s"])
            runs.append({
                "config": name,
                "bandwidth_mbit": bw,
                "step_time_s": c["median_s"],
                "bytes_per_step": c["bytes_per_step"],
                "n_processes": n_proc,
                "min_s": c["min_s"],
                "iqr_s": c["iqr_s"],
                "n_samples": c["n"],
                "speedup_vs_fp32": c["speedup_vs_fp32"],
                "speedup_vs_bf16": c["speedup_vs_bf16"],
                "devices_per_process": p0.get("local_device_count"),
            })
        entry.update(n_processes=n_proc, configs=configs)
        bandwidths.append(entry)

    # compute-only reference (unshaped) and communication share of each shaped step
    unshaped = next((b for b in bandwidths if b["bandwidth_mbit"] is None and "configs" in b), None)
    for b in bandwidths:
        if "configs" not in b or unshaped is None or b is unshaped:
            continue
        for name, c in b["configs"].items():
            ref = unshaped["configs"].get(name)
            if ref is not None and c["median_s"] > 0:
                c["comm_share_est"] = max(0.0, 1.0 - ref["median_s"] / c["median_s"])
                # what the step would take if compute and transfer did not overlap at all
                c["serial_est_s"] = c["ideal_comm_s"] + ref["median_s"]
        base = b["configs"].get("fp32", {}).get("serial_est_s")
        for name, c in b["configs"].items():
            if "serial_est_s" in c:
                c["serial_est_speedup_vs_fp32"] = _ratio(base, c["serial_est_s"])

    doc: dict[str, Any] = {
        "benchmark": "qsdp_jax network speedup (experiments.bench.network)",
        "note": SHAPER_NOTE,
        "burst_note": BURST_NOTE,
        "timing": (
            "configs timed alternately in the same processes (time_alternating, warm-up "
            "excluded); a sample is the per-call max over processes; step_time_s = median"
        ),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if model_info is not None:
        doc.update(model_info)
    if meta:
        doc.update(dict(meta))
    doc["targets"] = evaluate_targets(bandwidths)
    doc["bandwidths"] = bandwidths
    doc["runs"] = runs
    return doc


def evaluate_targets(bandwidths: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Speedup targets over fp32 at the lowest shaped bandwidth that was measured."""
    shaped = [b for b in bandwidths if b["bandwidth_mbit"] is not None and "configs" in b]
    if not shaped:
        return {"bandwidth_mbit": None, "evaluated": False,
                "reason": "no shaped bandwidth was measured", "checks": {}}
    low = min(shaped, key=lambda b: b["bandwidth_mbit"])
    checks = {}
    for name, need in TARGETS.items():
        c = low["configs"].get(name)
        got = None if c is None else c.get("speedup_vs_fp32")
        checks[name] = {"required_speedup_vs_fp32": need, "speedup_vs_fp32": got,
                        "met": None if got is None else bool(got >= need)}
    met = [v["met"] for v in checks.values()]
    return {"bandwidth_mbit": low["bandwidth_mbit"], "evaluated": True,
            "all_met": all(m is True for m in met), "checks": checks}


def _bw_label(bw) -> str:
    if bw is None:
        return "unshaped"
    return f"{bw:g} Mbit/s" if bw < 1000 else f"{bw / 1000:g} Gbit/s"


def format_table(doc: Mapping[str, Any]) -> str:
    """Bandwidth x config: step time, speedup vs fp32, vs bf16, MB/step (per process)."""
    header = (f"{'bandwidth':<12} {'config':<10} {'step [s]':>9} {'IQR [s]':>8} {'n':>3} "
              f"{'vs fp32':>8} {'vs bf16':>8} {'MB/step':>8} {'ideal comm [s]':>14}")
    lines = [header, "-" * len(header)]
    fmt_x = lambda v: f"{v:7.2f}x" if v is not None else f"{'-':>8}"  # noqa: E731
    for b in doc["bandwidths"]:
        label = _bw_label(b["bandwidth_mbit"])
        if "error" in b:
            lines.append(f"{label:<12} FAILED: {b['error'].splitlines()[0][:100]}")
            continue
        for name, c in b["configs"].items():
            ideal = c.get("ideal_comm_s")
            lines.append(
                f"{label:<12} {name:<10} {c['median_s']:9.3f} {c['iqr_s']:8.3f} {c['n']:>3} "
                f"{fmt_x(c['speedup_vs_fp32'])} {fmt_x(c['speedup_vs_bf16'])} "
                f"{c['bytes_per_step'] / 1e6:8.2f} "
                + (f"{ideal:14.3f}" if ideal is not None else f"{'-':>14}")
            )
            label = ""
    t = doc.get("targets", {})
    if t.get("evaluated"):
        lines.append("")
        lines.append(f"targets at {_bw_label(t['bandwidth_mbit'])} (speedup over fp32 FSDP):")
        for name, chk in t["checks"].items():
            got = chk["speedup_vs_fp32"]
            status = "n/a" if chk["met"] is None else ("MET" if chk["met"] else "NOT met")
            got_s = "-" if got is None else f"{got:.2f}x"
            lines.append(f"  {name}: {got_s} (need >= {chk['required_speedup_vs_fp32']}x) {status}")
    serial = []
    for b in doc["bandwidths"]:
        cs = b.get("configs", {})
        parts = [f"{n} {c['serial_est_speedup_vs_fp32']:.2f}x" for n, c in cs.items()
                 if n != "fp32" and c.get("serial_est_speedup_vs_fp32") is not None]
        if parts:
            serial.append(f"  {_bw_label(b['bandwidth_mbit'])}: " + ", ".join(parts))
    if serial:
        lines.append("")
        lines.append("no-overlap estimate (ideal comm + unshaped step), speedup vs fp32:")
        lines.extend(serial)
    lines.append("")
    lines.append("MB/step = bytes one process sends per step (comm_report of the compiled step).")
    lines.append("Note: " + SHAPER_NOTE)
    if any(b.get("bandwidth_mbit") is not None and "configs" in b for b in doc["bandwidths"]):
        lines.append("Note: " + BURST_NOTE)
    return "\n".join(lines)


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _clean_floats(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean_floats(v) for v in x]
    return x


# ------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    from experiments.shelf.network_workload import CONFIG_NAMES, DEFAULT_MODEL

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
    p.add_argument("--bandwidths", nargs="+", default=list(DEFAULT_BANDWIDTHS),
                   help="Mbit/s of the shaped loopback (total for all traffic), or 'none'")
    p.add_argument("--no-netns", action="store_true",
                   help="no namespace: only the unshaped measurement, on the host loopback")
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
    p.add_argument("--fast-compile", action="store_true",
                   help="compile with XLA backend optimisation level 0 (smoke tests only: "
                        "slower steps, not representative timings)")
    return p


def _measure(bw, args, kwargs) -> dict[str, Any]:
    from experiments.shelf.multiproc import run_processes
    from experiments.shelf.netns import shaped_namespace

    run = lambda ns: run_processes(  # noqa: E731
        WORKLOAD, "network_benchmark", args.num_processes, kwargs,
        devices_per_process=args.devices_per_process, netns=ns, timeout_s=args.timeout,
    )
    t0 = time.perf_counter()
    if args.no_netns:
        procs = run(None)
        ns_name = None
    else:
        # run_processes kills and reaps its workers before returning or raising, so the
        # namespace is empty when shaped_namespace deletes it (on every exit path).
        with shaped_namespace(name_prefix="qsdpbench", rate_mbit=bw, mtu=args.mtu,
                              burst_kb=args.burst_kb) as ns:
            ns_name = ns.name
            procs = run(ns)
    return {"bandwidth_mbit": bw, "netns": ns_name, "processes": procs,
            "wall_s": time.perf_counter() - t0}


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
            print(f"--no-netns: skipping shaped bandwidths {dropped} (they need a namespace)",
                  file=sys.stderr)
        bws = [None]
    else:
        from experiments.shelf.netns import check_netns_support

        reason = check_netns_support()
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

    model = dict(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                 seq_len=args.seq_len, vocab_size=256)
    kwargs = dict(model=model, batch_per_process=args.batch_per_process, configs=args.configs,
                  repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                  compiler_options=FAST_COMPILE if args.fast_compile else None)
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
        "host": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    t_start = time.perf_counter()
    measurements: list[dict] = []
    failed = False
    try:
        for bw in bws:
            print(f"[bench.network] {_bw_label(bw)}: starting {args.num_processes} processes "
                  f"({'no namespace' if args.no_netns else 'in a network namespace'})...", flush=True)
            try:
                m = _measure(bw, args, kwargs)
            except Exception as e:  # noqa: BLE001 - WorkerError, NetnsError: record, go on
                failed = True
                print(f"[bench.network] {_bw_label(bw)} FAILED:\n{e}", file=sys.stderr, flush=True)
                measurements.append({"bandwidth_mbit": bw, "error": f"{type(e).__name__}: {e}"})
                continue
            measurements.append(m)
            cfgs = m["processes"][0]["configs"]
            print(f"[bench.network] {_bw_label(bw)}: done in {m['wall_s']:.0f} s; medians "
                  + ", ".join(f"{n} {c['median_s']:.3f}s" for n, c in cfgs.items()), flush=True)
    except KeyboardInterrupt:
        print("\n[bench.network] interrupted; workers killed, namespaces removed", file=sys.stderr)
        return 130

    meta["wall_s"] = time.perf_counter() - t_start
    meta["host"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    meta["run_wall_s"] = {str(m["bandwidth_mbit"]): m.get("wall_s") for m in measurements}
    doc = _clean_floats(assemble_results(measurements, meta))
    print()
    print(format_table(doc))
    _write_json(args.out, doc)
    print(f"\nwrote {args.out}  (total wall time {meta['wall_s']:.0f} s)")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
