"""Cluster-scale prediction of QSDP's step-time speedup over FSDP, from compiled-step bytes.

    python -m experiments.bench.speedup_model [--devices 8] [--models gpt-125m gpt-350m gpt-1.3b]
        [--bandwidths-gbit 10 25 100 400] [--nodes 2 4 8 16 32 64] [--gpus-per-node 8]
        [--peak-tflops 312] [--mfu 0.4] [--global-batch-tokens 524288]
        [--algorithm ring|hierarchical] [--network-json experiments/results/network.json]
        [--out experiments/results]

What is measured and what is modelled
-------------------------------------
1. **Bytes (measured).** For each GPT-2 shape (``gpt-125m``, ``gpt-350m``, ``gpt-1.3b`` of
   ``experiments.gpt.model``) and each scheme the real train step is compiled, never run, from an
   abstract state (``qsdp_jax.abstract_train_state``) on ``--devices`` simulated CPU devices,
   and ``qsdp_jax.comm.comm_report`` counts the bytes one device sends per step
   (``experiments.shelf.wire_bytes.measure``; all collectives: gathers, reduce-scatters and the small
   all-reduce of replicated leaves). The batch is ``devices x seq_len``: the collective bytes of
   FSDP do not depend on the batch.
2. **Scaling to N GPUs (analytic).** In ring FSDP every collective moves ``(N-1)/N`` (twice
   that for an all-reduce) of a volume ``V`` that depends only on the model and the scheme:
   all-gather and reduce-scatter of each buffer. So ``V = bytes_8 / (7/8)`` is recovered from
   the 8-device compile and re-scaled with ``(N-1)/N`` for ``N = nodes x gpus_per_node``
   (:func:`collective_volume`, :func:`ring_factor`). Ignored: the flat buffers' padding to a
   multiple of ``N x bucket`` elements, which grows with N (a few % for gpt-125m at 512 GPUs, in
   every scheme alike, so it barely moves the speedups).
3. **The network (modelled).** The paper (QSDP, Markov et al. 2023) measured multi-node
   clusters with 8 GPUs per node, where the inter-node link is the bottleneck. Here intra-node
   traffic (NVLink) is free and the time of the collectives is the bytes leaving one node over
   that node's bandwidth, at line rate (100% link efficiency) and with no latency term:
   ``t_comm = link_bytes * 8 / bandwidth_bps`` (:func:`comm_time`).
   ``--algorithm ring`` (default; NCCL's flat rings): the GPUs of a node are consecutive on
   the ring, so each node has one outgoing inter-node ring edge per channel, and every ring
   edge carries ``(N-1)/N x V``; with C channels each carries ``V/C``, so the bytes leaving a
   node are ``(N-1)/N x V``, the same as one GPU's. ``--algorithm hierarchical`` (intra-node
   reduce-scatter first, then an inter-node ring per local rank): ``(M-1)/M x V`` for M nodes;
   fewer bytes, so it predicts smaller speedups at small node counts.
   (:func:`link_bytes_per_step`.) A single node (M = 1) sends nothing between nodes.
4. **Compute (modelled).** ``t_compute = flops_per_token x tokens_per_gpu / rate``
   (:func:`compute_time`), with ``flops_per_token`` from ``experiments.gpt.model`` (6 x matmul
   params + attention, model FLOPs, no rematerialisation), ``tokens_per_gpu =
   global_batch_tokens / N`` (default 0.5M = 524288 tokens per step, a fixed global batch:
   strong scaling, so compute per GPU shrinks with N while communication per node does not)
   and ``rate = peak x MFU`` (default an A100's 312 TFLOP/s bf16 peak at 40% MFU = 124.8
   TFLOP/s). MFU absorbs remat, the optimizer and everything else that is not a collective.
   QSDP's quantize / dequantize work is *not* charged: it is assumed hidden in the same MFU
   (optimistic for QSDP, a few % of a step on a GPU).
5. **Step time** (:func:`predict_step_time`). No overlap: ``t = t_compute + t_comm``. Overlap:
   a fraction ``e = 1 / n_layers`` of the communication is exposed (about one layer's worth:
   the first layer's all-gather before any compute, the last reduce-scatter after it) and the
   rest runs behind compute: ``t = max(t_compute, (1 - e) t_comm) + e t_comm``. (Unlike
   ``max(t_compute, t_comm) + e t_comm`` this never exceeds the no-overlap time: when
   communication dominates, it is ``t_comm``.) Speedup of a scheme = fp32's step time / its
   step time, at the same model, bandwidth, node count and overlap mode.

Which way the assumptions lean: line-rate links and the hierarchical option make communication
cheaper, so speedups smaller (conservative); no latency term and free quantization compute make
QSDP look better (optimistic). The no-overlap and overlap panels bracket real FSDP, which
overlaps partially.

Model check
-----------
:func:`check_against_network` compares the model with the shaped-network runs of
``experiments.bench.network`` (``network.json``), assumed to be::

    {"runs": [{"config": "fp32", "bandwidth_mbit": 100 (or null: unshaped),
               "step_time_s": 1.23, "bytes_per_step": 4.5e6, "n_processes": 2}, ...]}

(``bytes_per_step``: bytes one process sends per step; extra keys are ignored.) For each
shaped (config, bandwidth) it predicts the step time from that config's unshaped step time
(as the compute time; it still includes the loopback's own transfer time) and the measured
bytes. The shaper of ``experiments.shelf.netns`` is one queue for all processes, so by default the
bytes through it are ``bytes_per_step x n_processes`` (``shared_queue=True``).

Writes ``<out>/speedup_model.json`` (inputs, assumptions, measured bytes, every prediction, the
check) and ``<out>/speedup_model.png`` (speedup of QSDP W8G8 and W4G4 over fp32 against nodes,
one line per bandwidth, for gpt-1.3b; no overlap and overlap side by side).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from experiments.gpt.devices import simulate_cpu_devices
from experiments.shelf import wire_bytes

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"
DEFAULT_MODELS = ("gpt-125m", "gpt-350m", "gpt-1.3b")
DEFAULT_SCHEMES = ("fp32", "bf16", "qsdp-W8G8", "qsdp-W6G6", "qsdp-W4G8", "qsdp-W4G4")
DEFAULT_BANDWIDTHS_GBIT = (10.0, 25.0, 100.0, 400.0)
DEFAULT_NODES = (2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = 8
A100_BF16_PEAK_FLOPS = 312e12
DEFAULT_MFU = 0.4
DEFAULT_GLOBAL_BATCH_TOKENS = 2**19  # 524288
ALGORITHMS = ("ring", "hierarchical")
PLOT_MODEL = "gpt-1.3b"
PLOT_SCHEMES = ("qsdp-W8G8", "qsdp-W4G4")


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _number(name: str, x, *, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name} must be a number, got {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    if positive and x <= 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return x


def _count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    return n


# ----------------------------------------------------------------------------------------------
# The model: small pure functions
# ----------------------------------------------------------------------------------------------
def ring_factor(n_devices: int) -> float:
    """``(N-1)/N``: the fraction of a collective's volume one ring member sends."""
    n = _count("n_devices", n_devices)
    return (n - 1) / n


def collective_volume(bytes_per_device: float, n_devices: int) -> float:
    """The scheme's collective volume ``V`` from bytes one device sends on ``n_devices``."""
    b = _number("bytes_per_device", bytes_per_device)
    f = ring_factor(n_devices)
    if f == 0:
        raise ValueError("cannot recover the volume from a 1-device measurement (no traffic)")
    return b / f


def scale_bytes(bytes_per_device: float, n_from: int, n_to: int) -> float:
    """Per-device bytes measured on ``n_from`` devices, re-scaled to ``n_to`` (``(N-1)/N``)."""
    return collective_volume(bytes_per_device, n_from) * ring_factor(n_to)


def link_bytes_per_step(
    volume: float, n_nodes: int, gpus_per_node: int = GPUS_PER_NODE, algorithm: str = "ring"
) -> float:
    """Bytes leaving one node per step (see the module docstring, point 3).

    ``ring``: ``V * (N-1)/N`` with ``N = n_nodes * gpus_per_node``; ``hierarchical``:
    ``V * (M-1)/M`` with ``M = n_nodes``. Zero for a single node.
    """
    v = _number("volume", volume)
    m = _count("n_nodes", n_nodes)
    g = _count("gpus_per_node", gpus_per_node)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if m == 1:
        return 0.0
    return v * (ring_factor(m * g) if algorithm == "ring" else ring_factor(m))


def comm_time(link_bytes: float, bandwidth_bps: float) -> float:
    """Seconds to push ``link_bytes`` through a link of ``bandwidth_bps`` bits per second."""
    return _number("link_bytes", link_bytes) * 8 / _number("bandwidth_bps", bandwidth_bps, positive=True)


def compute_time(flops: float, rate: float) -> float:
    """Seconds of compute for ``flops`` at ``rate`` FLOP/s."""
    return _number("flops", flops) / _number("rate", rate, positive=True)


def combine(t_compute: float, t_comm: float, overlap: bool, exposed_fraction: float = 0.0) -> float:
    """Step time from its parts: ``t_compute + t_comm`` without overlap, else
    ``max(t_compute, (1 - e) * t_comm) + e * t_comm`` with ``e = exposed_fraction``: the exposed
    part of the communication runs alone, the rest behind compute."""
    tc = _number("t_compute", t_compute)
    tm = _number("t_comm", t_comm)
    e = _number("exposed_fraction", exposed_fraction)
    if e > 1:
        raise ValueError(f"exposed_fraction must be in [0, 1], got {exposed_fraction!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool, got {overlap!r}")
    return max(tc, (1 - e) * tm) + e * tm if overlap else tc + tm


def predict_step_time(
    link_bytes: float,
    flops: float,
    rate: float,
    bandwidth_bps: float,
    overlap: bool,
    exposed_fraction: float = 0.0,
) -> float:
    """Seconds per step: ``flops`` per GPU at ``rate`` FLOP/s, ``link_bytes`` per step over the
    bottleneck link of ``bandwidth_bps`` bits/s, combined by :func:`combine`.

    E.g. 1e9 bytes at 100 Gbit/s is 0.08 s; with 1e12 FLOPs at 1e13 FLOP/s (0.1 s) the step
    takes 0.18 s without overlap, 0.1 s with full overlap and 0.12 s with a quarter of the
    communication exposed (``max(0.1, 0.06) + 0.02``).
    """
    return combine(compute_time(flops, rate), comm_time(link_bytes, bandwidth_bps), overlap, exposed_fraction)


def tokens_per_gpu(global_batch_tokens: float, n_gpus: int) -> float:
    return _number("global_batch_tokens", global_batch_tokens, positive=True) / _count("n_gpus", n_gpus)


# ----------------------------------------------------------------------------------------------
# The grid of predictions
# ----------------------------------------------------------------------------------------------
def predict_grid(
    measured: dict[str, dict],
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    bandwidths_gbit: Sequence[float] = DEFAULT_BANDWIDTHS_GBIT,
    nodes: Sequence[int] = DEFAULT_NODES,
    gpus_per_node: int = GPUS_PER_NODE,
    rate: float = A100_BF16_PEAK_FLOPS * DEFAULT_MFU,
    global_batch_tokens: float = DEFAULT_GLOBAL_BATCH_TOKENS,
    algorithm: str = "ring",
) -> list[dict]:
    """One row per (model, bandwidth, nodes, scheme).

    ``measured[model]`` needs ``n_devices`` (of the compile), ``n_layers``, ``flops_per_token``
    and ``bytes_per_device`` ``{scheme: bytes}``. Speedups are against ``fp32`` (and ``bf16``)
    at the same model, bandwidth and node count, when those schemes are in ``schemes``.
    """
    rows: list[dict] = []
    for model, m in measured.items():
        n_meas = _count("n_devices", m["n_devices"])
        n_layers = _count("n_layers", m["n_layers"])
        for bw in bandwidths_gbit:
            bps = _number("bandwidth_gbit", bw, positive=True) * 1e9
            for n_nodes in nodes:
                n_gpus = _count("n_nodes", n_nodes) * _count("gpus_per_node", gpus_per_node)
                tokens = tokens_per_gpu(global_batch_tokens, n_gpus)
                flops = m["flops_per_token"] * tokens
                block = {}
                for s in schemes:
                    vol = collective_volume(m["bytes_per_device"][s], n_meas)
                    lb = link_bytes_per_step(vol, n_nodes, gpus_per_node, algorithm)
                    tc, tm = compute_time(flops, rate), comm_time(lb, bps)
                    block[s] = {
                        "model": model,
                        "scheme": s,
                        "bandwidth_gbit": float(bw),
                        "n_nodes": n_nodes,
                        "n_gpus": n_gpus,
                        "tokens_per_gpu": tokens,
                        "flops_per_gpu": flops,
                        "volume_bytes": vol,
                        "link_bytes": lb,
                        "t_compute_s": tc,
                        "t_comm_s": tm,
                        "t_step_s": combine(tc, tm, False),
                        "t_step_overlap_s": combine(tc, tm, True, 1 / n_layers),
                    }
                for r in block.values():
                    for ref in ("fp32", "bf16"):
                        b = block.get(ref)
                        r[f"speedup_vs_{ref}"] = b["t_step_s"] / r["t_step_s"] if b else None
                        r[f"speedup_vs_{ref}_overlap"] = b["t_step_overlap_s"] / r["t_step_overlap_s"] if b else None
                rows.extend(block.values())
    return rows


# ----------------------------------------------------------------------------------------------
# Check against the shaped-network runs
# ----------------------------------------------------------------------------------------------
def check_against_network(
    network_json_path: str | os.PathLike,
    *,
    shared_queue: bool = True,
    overlap: bool = False,
    exposed_fraction: float = 0.0,
) -> dict[str, Any]:
    """Predict each shaped run of ``network.json`` with the model and report the errors.

    For every (config, bandwidth_mbit) with a bandwidth, the compute time is the median
    unshaped (``bandwidth_mbit`` null) step time of that config, the link bytes are the median
    ``bytes_per_step`` times ``n_processes`` if ``shared_queue`` (one shaper queue for all
    processes, as in ``experiments.shelf.netns``) else times 1, and the prediction is
    :func:`combine` of the two. Returns ``{"skipped": True, "reason"}`` if the file does not
    exist, else ``pairs`` (config, bandwidth, measured, predicted, relative error),
    ``mean_abs_rel_error`` and ``unmatched`` (shaped configs with no unshaped run).
    """
    path = Path(network_json_path)
    if not path.exists():
        return {
            "skipped": True,
            "reason": f"{path} does not exist yet (experiments.bench.network writes it); "
            "run the speedup model again afterwards to check it",
        }
    data = json.loads(path.read_text())
    runs = data.get("runs") if isinstance(data, dict) else data
    if not isinstance(runs, list):
        raise ValueError(f"{path}: expected {{'runs': [...]}} (see the module docstring)")
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for r in runs:
        try:
            key = (str(r["config"]), None if r.get("bandwidth_mbit") is None else float(r["bandwidth_mbit"]))
            float(r["step_time_s"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: bad run {r!r}: needs config, bandwidth_mbit, step_time_s ({e})") from None
        groups.setdefault(key, []).append(r)
    unshaped = {
        cfg: statistics.median(float(r["step_time_s"]) for r in rs) for (cfg, bw), rs in groups.items() if bw is None
    }
    pairs: list[dict[str, Any]] = []
    unmatched: list[dict] = []
    for (cfg, bw), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        if bw is None:
            continue
        if cfg not in unshaped:
            unmatched.append({"config": cfg, "bandwidth_mbit": bw, "why": "no unshaped run"})
            continue
        measured = statistics.median(float(r["step_time_s"]) for r in rs)
        sent = statistics.median(float(r["bytes_per_step"]) for r in rs)
        n_proc = int(rs[0].get("n_processes", 2))
        link = sent * (n_proc if shared_queue else 1)
        tc, tm = unshaped[cfg], comm_time(link, bw * 1e6)
        pred = combine(tc, tm, overlap, exposed_fraction)
        pairs.append(
            {
                "config": cfg,
                "bandwidth_mbit": bw,
                "n_processes": n_proc,
                "n_runs": len(rs),
                "bytes_per_step": sent,
                "link_bytes": link,
                "t_compute_s": tc,
                "t_comm_s": tm,
                "measured_s": measured,
                "predicted_s": pred,
                "rel_error": (pred - measured) / measured,
            }
        )
    mare = statistics.fmean(abs(p["rel_error"]) for p in pairs) if pairs else None
    return {
        "skipped": False,
        "path": str(path),
        "shared_queue": shared_queue,
        "overlap": overlap,
        "exposed_fraction": exposed_fraction,
        "pairs": pairs,
        "mean_abs_rel_error": mare,
        "unmatched": unmatched,
    }


def check_table(check: dict) -> str:
    if check.get("skipped"):
        return f"model check skipped: {check['reason']}"
    lines = [
        f"model check against {check['path']} (shared queue: {check['shared_queue']}, overlap: {check['overlap']})",
        f"{'config':<14}{'Mbit/s':>8}{'MB/step':>9}{'t_comp':>8}{'measured':>10}{'predicted':>10}{'rel err':>9}",
    ]
    for p in check["pairs"]:
        lines.append(
            f"{p['config']:<14}{p['bandwidth_mbit']:>8g}{p['bytes_per_step'] / 1e6:>9.2f}"
            f"{p['t_compute_s']:>8.3f}{p['measured_s']:>10.3f}{p['predicted_s']:>10.3f}"
            f"{100 * p['rel_error']:>+8.1f}%"
        )
    if check["mean_abs_rel_error"] is not None:
        lines.append(f"mean absolute relative error: {100 * check['mean_abs_rel_error']:.1f}%")
    for u in check["unmatched"]:
        lines.append(f"unmatched: {u}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Measurement, output
# ----------------------------------------------------------------------------------------------
def measure_models(models: Sequence[str], schemes: Sequence[str], n_devices: int, bucket: int) -> dict:
    """Compile each model abstractly and count bytes (``experiments.shelf.wire_bytes.measure``)."""
    out = {}
    for model in models:  # batch: n_devices sequences (the bytes do not depend on it)
        res = wire_bytes.measure(model, schemes, n_devices=n_devices, bucket=bucket, batch_size=n_devices, verbose=True)
        out[model] = {
            "n_params": res["n_params"],
            "n_layers": res["n_layers"],
            "flops_per_token": res["flops_per_token"],
            "n_devices": res["n_devices"],
            "bucket_size": bucket,
            "bytes_per_device": {s: r["total_bytes"] for s, r in res["schemes"].items()},
            "by_kind": {s: r["by_kind"] for s, r in res["schemes"].items()},
            "formula_rel_diff": {s: r["formula_rel_diff"] for s, r in res["schemes"].items()},
        }
    return out


def _short(s: str) -> str:
    return s.replace("qsdp-", "")


def table(rows: list[dict], measured: dict, schemes: Sequence[str], nodes_for: dict | None = None) -> str:
    """Per model: rows (bandwidth, nodes), fp32 step time and speedups over fp32, both modes."""
    nodes_for = nodes_for or {}
    others = [s for s in schemes if s != "fp32"]
    out = []
    for model, m in measured.items():
        keep = nodes_for.get(model)
        sel = [r for r in rows if r["model"] == model and (keep is None or r["n_nodes"] in keep)]
        out.append(
            f"{model}: {m['n_params'] / 1e6:.0f}M params, {m['flops_per_token'] / 1e9:.2f} GFLOP/token, "
            f"{m['n_layers']} layers; fp32 volume {collective_volume(m['bytes_per_device']['fp32'], m['n_devices']) / 1e9:.2f} GB/step"
        )
        sp = "".join(f"{_short(s):>6}" for s in others)
        head = f"{'Gbit/s':>6}{'nodes':>6}{'tok/GPU':>8} | {'fp32 s':>7}{sp} | {'fp32 s':>7}{sp}"
        out.append(f"{'':20} | {'no overlap: speedup vs fp32':<{7 + 6 * len(others)}} | overlap")
        out.append(head)
        by = {(r["bandwidth_gbit"], r["n_nodes"], r["scheme"]): r for r in sel}
        for bw, n in sorted({(r["bandwidth_gbit"], r["n_nodes"]) for r in sel}):
            f = by[(bw, n, "fp32")]
            a = "".join(f"{by[(bw, n, s)]['speedup_vs_fp32']:>6.2f}" for s in others)
            b = "".join(f"{by[(bw, n, s)]['speedup_vs_fp32_overlap']:>6.2f}" for s in others)
            out.append(
                f"{bw:>6g}{n:>6}{f['tokens_per_gpu']:>8.0f} | {f['t_step_s']:>7.3f}{a} | "
                f"{f['t_step_overlap_s']:>7.3f}{b}"
            )
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, model: str = PLOT_MODEL, schemes=PLOT_SCHEMES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["model"] == model]
    bws = sorted({r["bandwidth_gbit"] for r in sel})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, title in (
        (axes[0], "speedup_vs_fp32", "no overlap: t = compute + comm"),
        (axes[1], "speedup_vs_fp32_overlap", "overlap: t = max(compute, (1-e) comm) + e comm, e = 1/n_layers"),
    ):
        for i, bw in enumerate(bws):
            for j, s in enumerate(schemes):
                pts = sorted((r["n_nodes"], r[key]) for r in sel if r["bandwidth_gbit"] == bw and r["scheme"] == s)
                if pts:
                    ax.plot(
                        *zip(*pts),
                        styles[j % len(styles)],
                        color=colors[i % len(colors)],
                        marker="o",
                        markersize=3,
                        label=f"{_short(s)}, {bw:g} Gbit/s",
                    )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["n_nodes"] for r in sel})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("nodes (8 GPUs each)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted speedup over fp32 FSDP")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"{model}: predicted QSDP speedup (bytes from the compiled step; modelled network and compute)", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices to compile on")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument(
        "--bandwidths-gbit",
        nargs="+",
        type=float,
        default=list(DEFAULT_BANDWIDTHS_GBIT),
        help="per-node inter-node bandwidth, Gbit/s",
    )
    p.add_argument("--nodes", nargs="+", type=int, default=list(DEFAULT_NODES))
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE)
    p.add_argument(
        "--peak-tflops", type=float, default=A100_BF16_PEAK_FLOPS / 1e12, help="per-GPU peak (default A100 bf16: 312)"
    )
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilisation (0, 1]")
    p.add_argument("--global-batch-tokens", type=float, default=DEFAULT_GLOBAL_BATCH_TOKENS)
    p.add_argument("--algorithm", choices=ALGORITHMS, default="ring")
    p.add_argument("--network-json", type=Path, default=DEFAULT_OUT / "network.json")
    p.add_argument(
        "--no-shared-queue",
        dest="shared_queue",
        action="store_false",
        help="model check: each process has its own shaped link",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if not 0 < args.mfu <= 1:
        p.error(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.peak_tflops <= 0 or args.global_batch_tokens <= 0:
        p.error("--peak-tflops and --global-batch-tokens must be > 0")
    if any(b <= 0 for b in args.bandwidths_gbit) or any(n < 1 for n in args.nodes) or args.gpus_per_node < 1:
        p.error("bandwidths must be > 0, nodes and --gpus-per-node >= 1")
    if "fp32" not in args.schemes:
        p.error("--schemes must include fp32 (the baseline of the speedups)")
    return args


def main(argv=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    simulate_cpu_devices(args.devices)
    t0 = time.perf_counter()
    rate = args.peak_tflops * 1e12 * args.mfu
    measured = measure_models(args.models, args.schemes, args.devices, args.bucket)
    rows = predict_grid(
        measured,
        schemes=args.schemes,
        bandwidths_gbit=args.bandwidths_gbit,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        rate=rate,
        global_batch_tokens=args.global_batch_tokens,
        algorithm=args.algorithm,
    )
    # both step-time models: tbf's bucket refills during compute, so shaped runs overlap
    check = check_against_network(args.network_json, shared_queue=args.shared_queue)
    check_overlap = check_against_network(args.network_json, shared_queue=args.shared_queue, overlap=True)
    wall = time.perf_counter() - t0
    assumptions = {
        "bytes": f"measured: wire bytes per device per step of the compiled train step on "
        f"{args.devices} simulated devices (comm_report, ring model), all collectives",
        "scaling": "volume V = bytes / ((n-1)/n) at the compile's n; re-scaled by (N-1)/N, "
        "N = nodes * gpus_per_node; padding growth with N ignored",
        "network": f"inter-node link is the bottleneck, intra-node free; per-node bandwidth at "
        f"line rate, no latency; algorithm={args.algorithm}: bytes leaving a node = "
        + ("V*(N-1)/N" if args.algorithm == "ring" else "V*(M-1)/M, M nodes"),
        "compute": f"t_compute = flops_per_token (6*matmul params + attention, gpt/model.py) * "
        f"tokens_per_gpu / rate; rate = {args.peak_tflops:g} TFLOP/s peak * MFU "
        f"{args.mfu:g} = {rate / 1e12:.1f} TFLOP/s; quantization compute not charged",
        "batch": f"fixed global batch of {args.global_batch_tokens:g} tokens per step split over "
        "all GPUs (strong scaling)",
        "no_overlap": "t = t_compute + t_comm",
        "overlap": "t = max(t_compute, (1-e)*t_comm) + e*t_comm with e = 1/n_layers exposed "
        "(first gather / last reduce-scatter); never above the no-overlap time",
        "paper_setup": "the QSDP paper measured multi-node clusters with 8 GPUs per node where "
        "the inter-node link is the bottleneck; modelled the same way here",
        "gpus_per_node": args.gpus_per_node,
    }
    record = {
        "command": " ".join(["python -m experiments.bench.speedup_model", *map(shlex.quote, raw)]),
        "assumptions": assumptions,
        "inputs": {
            "devices_compiled": args.devices,
            "bucket_size": args.bucket,
            "bandwidths_gbit": args.bandwidths_gbit,
            "nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node,
            "peak_flops": args.peak_tflops * 1e12,
            "mfu": args.mfu,
            "rate_flops": rate,
            "global_batch_tokens": args.global_batch_tokens,
            "algorithm": args.algorithm,
        },
        "measured": measured,
        "predictions": rows,
        "network_check": check,
        "network_check_overlap": check_overlap,
        "wall_s": wall,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speedup_model.json").write_text(json.dumps(record, indent=1))
    png = args.out / "speedup_model.png"
    if PLOT_MODEL in measured:
        plot(rows, png)
    print()
    print(
        f"rate {rate / 1e12:.1f} TFLOP/s per GPU, global batch {args.global_batch_tokens:g} tokens, "
        f"{args.gpus_per_node} GPUs/node, algorithm {args.algorithm}; speedup = t_fp32 / t_scheme"
    )
    short_nodes = {m: [n for n in args.nodes if n in (2, 8, 64)] or None for m in measured if m != PLOT_MODEL}
    print(table(rows, measured, args.schemes, short_nodes))
    print(check_table(check))
    print(check_table(check_overlap))
    print(
        f"\nwrote {args.out / 'speedup_model.json'}"
        + (f" and {png}" if PLOT_MODEL in measured else "")
        + f" ({wall:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
