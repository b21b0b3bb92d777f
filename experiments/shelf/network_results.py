"""The results of the shaped-network benchmarks: worker timings combined across processes, the
JSON document, the speedup targets and the printed table. Shared by ``experiments.bench.network``
(1-D FSDP over 2 processes) and ``experiments.bench.twolevel`` (two-level meshes); no jax.

A step's time is the per-call maximum over the processes (the slower process defines the step;
the collectives keep them in lock-step). All processes share the namespace's one loopback
queue, so the shaped rate is the *total* rate of all traffic (:data:`SHAPER_NOTE`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.shelf.timing import quantile

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
        raise argparse.ArgumentTypeError(f"bandwidth must be a number of Mbit/s or 'none', got {text!r}") from None
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
                for k in (
                    "model",
                    "n_params",
                    "batch_per_process",
                    "global_batch",
                    "device_count",
                    "local_device_count",
                    "process_count",
                )
            }
        configs: dict[str, dict] = {}
        for name in p0["configs"]:
            c = combine_processes(procs, name)
            c["shaper_bytes_per_step"] = c["bytes_per_step"] * n_proc
            c["ideal_comm_s"] = None if bw is None else c["shaper_bytes_per_step"] * 8 / (bw * 1e6)
            configs[name] = c
        base32 = configs.get("fp32", {}).get("median_s")
        base16 = configs.get("bf16", {}).get("median_s")
        for name, c in configs.items():
            c["speedup_vs_fp32"] = _ratio(base32, c["median_s"])
            c["speedup_vs_bf16"] = _ratio(base16, c["median_s"])
            runs.append(
                {
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
                }
            )
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
        return {"bandwidth_mbit": None, "evaluated": False, "reason": "no shaped bandwidth was measured", "checks": {}}
    low = min(shaped, key=lambda b: b["bandwidth_mbit"])
    checks = {}
    for name, need in TARGETS.items():
        c = low["configs"].get(name)
        got = None if c is None else c.get("speedup_vs_fp32")
        checks[name] = {
            "required_speedup_vs_fp32": need,
            "speedup_vs_fp32": got,
            "met": None if got is None else bool(got >= need),
        }
    met = [v["met"] for v in checks.values()]
    return {
        "bandwidth_mbit": low["bandwidth_mbit"],
        "evaluated": True,
        "all_met": all(m is True for m in met),
        "checks": checks,
    }


def bw_label(bw) -> str:
    if bw is None:
        return "unshaped"
    return f"{bw:g} Mbit/s" if bw < 1000 else f"{bw / 1000:g} Gbit/s"


def format_table(doc: Mapping[str, Any]) -> str:
    """Bandwidth x config: step time, speedup vs fp32, vs bf16, MB/step (per process)."""
    header = (
        f"{'bandwidth':<12} {'config':<10} {'step [s]':>9} {'IQR [s]':>8} {'n':>3} "
        f"{'vs fp32':>8} {'vs bf16':>8} {'MB/step':>8} {'ideal comm [s]':>14}"
    )
    lines = [header, "-" * len(header)]
    fmt_x = lambda v: f"{v:7.2f}x" if v is not None else f"{'-':>8}"  # noqa: E731
    for b in doc["bandwidths"]:
        label = bw_label(b["bandwidth_mbit"])
        if "error" in b:
            lines.append(f"{label:<12} FAILED: {b['error'].splitlines()[0][:100]}")
            continue
        for name, c in b["configs"].items():
            ideal = c.get("ideal_comm_s")
            lines.append(
                f"{label:<12} {name:<10} {c['median_s']:9.3f} {c['iqr_s']:8.3f} {c['n']:>3} "
                f"{fmt_x(c['speedup_vs_fp32'])} {fmt_x(c['speedup_vs_bf16'])} "
                f"{c['bytes_per_step'] / 1e6:8.2f} " + (f"{ideal:14.3f}" if ideal is not None else f"{'-':>14}")
            )
            label = ""
    t = doc.get("targets", {})
    if t.get("evaluated"):
        lines.append("")
        lines.append(f"targets at {bw_label(t['bandwidth_mbit'])} (speedup over fp32 FSDP):")
        for name, chk in t["checks"].items():
            got = chk["speedup_vs_fp32"]
            status = "n/a" if chk["met"] is None else ("MET" if chk["met"] else "NOT met")
            got_s = "-" if got is None else f"{got:.2f}x"
            lines.append(f"  {name}: {got_s} (need >= {chk['required_speedup_vs_fp32']}x) {status}")
    serial = []
    for b in doc["bandwidths"]:
        cs = b.get("configs", {})
        parts = [
            f"{n} {c['serial_est_speedup_vs_fp32']:.2f}x"
            for n, c in cs.items()
            if n != "fp32" and c.get("serial_est_speedup_vs_fp32") is not None
        ]
        if parts:
            serial.append(f"  {bw_label(b['bandwidth_mbit'])}: " + ", ".join(parts))
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


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def clean_floats(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_floats(v) for v in x]
    return x
