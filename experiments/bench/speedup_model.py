"""QSDP's modelled step time on more nodes: the compiled-program model of ``experiments.bench.aot``
scaled from the program compiled for two nodes to 2..64 nodes.

    python -m experiments.bench.speedup_model [--target h100-16] [--nodes 2 4 8 16 32 64]
        [--bandwidths-gbit 25 100 400] [--tokens-per-chip N | --global-batch-tokens N]
        [--aot experiments/results/aot.json] [--network-json experiments/results/network.json]
        [--out experiments/results]

A MODEL, not a measurement. Its inputs come from the rows ``experiments.bench.aot`` wrote for a
target of several nodes (by default ``h100-16``: 2 nodes x 8 H100, compiled by XLA:GPU on this
host): each row's ``collective_classes`` (every collective of the compiled step by kind, group
size, whether its group spans nodes and whether the schedule hides it behind a matmul, with its
bytes per chip) and the chip's published peak. ``experiments.shelf.step_model`` turns them into a
step time (its docstring has the assumptions): compute = training FLOPs per chip
(``aot.model_flops``) over the peak bf16 rate; a collective spanning nodes at ``--bandwidths-gbit``
per chip (one NIC per GPU), one inside a node at NVLink's rate; the hidden collectives behind
compute (``as scheduled``: ``max(compute, hidden) + exposed``) or nothing hidden (``no overlap``).
On N = nodes x 8 chips each ring collective's bytes scale with its group, ``(g-1)/g``: a group over
all chips or over the node axis of a two-level mesh grows with the node count, one inside a node
does not. With 2 nodes and the compiled batch the figures are the aot rows' ``model_time_nodes``.

The batch: ``--tokens-per-chip`` (default: the compiled one, one 1024-token sequence per chip:
weak scaling) or ``--global-batch-tokens`` (a fixed global batch split over all chips: strong
scaling). Speedups are against the plain GSPMD step (``gspmd``) and fp32 FSDP (``fp32``) at the
same model, bandwidth and node count.

Model check: :func:`check_against_network` predicts the shaped-network runs of
``experiments.bench.network`` (``network.json``: ``{"runs": [{"config", "bandwidth_mbit" (null:
unshaped), "step_time_s", "bytes_per_step", "n_processes"}, ...]}``) from each config's unshaped
step time (as compute) and its bytes through the shaper (``bytes_per_step x n_processes``: one
queue for all processes, as in ``experiments.shelf.netns``), combined by the same
``step_model.combine``, with nothing hidden and with everything hidden.

Writes ``<out>/speedup_model.json`` (inputs, every prediction, the check) and
``<out>/speedup_model.png`` (speedup over GSPMD of QSDP W8G8 and W4G4 at GPT-1.3B against nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from experiments.bench.aot import model_flops, node_model
from experiments.shelf import step_model
from experiments.shelf.targets import TARGETS

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_TARGET = "h100-16"
DEFAULT_BANDWIDTHS_GBIT = (25.0, 100.0, 400.0)
DEFAULT_NODES = (2, 4, 8, 16, 32, 64)
BASELINES = ("gspmd", "fp32")
PLOT_MODEL = "gpt-1.3b"
PLOT_SCHEMES = ("qsdp-W8G8", "qsdp-W4G4", "qsdp-W8G8+2level")


def target_rows(aot_doc: dict, target: str) -> list[dict]:
    """The rows of ``target`` in an aot.json document; a clear error where they cannot be scaled."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not known; known: {sorted(TARGETS)}")
    if TARGETS[target].hosts < 2:
        raise ValueError(
            f"target {target!r} is one node: its program has no collective across nodes to scale; "
            f"name a target of several nodes ({sorted(t for t, v in TARGETS.items() if v.hosts > 1)})"
        )
    rows = [r for r in aot_doc.get("rows", []) if r.get("target") == target]
    make = f"python -m experiments.bench.aot --targets {target} --models gpt-1.3b --schemes gspmd fp32 qsdp-W8G8"
    if not rows:
        raise ValueError(f"no rows for {target!r} in the aot results; make them with `{make}`")
    old = [f"{r['model']} {r['scheme']}" for r in rows if "collective_classes" not in r]
    if old:
        raise ValueError(f"rows without collective_classes (written before they were kept): {old}; `{make} --fresh`")
    return rows


def predict(
    rows: Sequence[dict],
    *,
    bandwidths_gbit: Sequence[float] = DEFAULT_BANDWIDTHS_GBIT,
    nodes: Sequence[int] = DEFAULT_NODES,
    tokens_per_chip: float | None = None,
    global_batch_tokens: float | None = None,
) -> list[dict]:
    """One prediction per (row, bandwidth, node count): ``aot.node_model`` on ``nodes x chips per
    node`` chips, with the speedups over each baseline row of the same model."""
    if tokens_per_chip is not None and global_batch_tokens is not None:
        raise ValueError("give tokens_per_chip or global_batch_tokens, not both")
    for name, x in (("tokens_per_chip", tokens_per_chip), ("global_batch_tokens", global_batch_tokens)):
        if x is not None and not x > 0:
            raise ValueError(f"{name} must be > 0, got {x!r}")
    if any(not b > 0 for b in bandwidths_gbit) or any(not isinstance(n, int) or n < 1 for n in nodes):
        raise ValueError(f"bandwidths must be > 0 and nodes integers >= 1, got {bandwidths_gbit}, {nodes}")
    out = []
    for r in rows:
        target = TARGETS[r["target"]]
        for gbps in bandwidths_gbit:
            for n_nodes in nodes:
                n = n_nodes * target.chips_per_host
                per_chip = tokens_per_chip or (
                    global_batch_tokens / n if global_batch_tokens else r["tokens"] / r["n_chips"]
                )
                m = node_model(target, model_flops(r["model"], per_chip * n), r["collective_classes"], gbps, n)
                out.append(
                    {"model": r["model"], "scheme": r["scheme"], "bandwidth_gbit": float(gbps), "n_nodes": n_nodes}
                    | {"tokens_per_chip": per_chip, **m}
                )
    by = {(p["model"], p["bandwidth_gbit"], p["n_nodes"], p["scheme"]): p for p in out}
    for p in out:
        for ref in BASELINES:
            b = by.get((p["model"], p["bandwidth_gbit"], p["n_nodes"], ref))
            for key in ("step_s", "step_no_overlap_s"):
                p[f"speedup_vs_{ref}{key[4:-2]}"] = b[key] / p[key] if b else None
    return out


def check_against_network(network_json_path: str | os.PathLike, *, shared_queue: bool = True) -> dict[str, Any]:
    """Predict each shaped run of ``network.json`` (module docstring) with nothing hidden and with
    everything hidden; ``{"skipped": True, "reason"}`` without the file."""
    path = Path(network_json_path)
    if not path.exists():
        return {"skipped": True, "reason": f"{path} does not exist yet (experiments.bench.network writes it)"}
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
        c: statistics.median(float(r["step_time_s"]) for r in rs) for (c, bw), rs in groups.items() if bw is None
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
        tc, tm = unshaped[cfg], sent * (n_proc if shared_queue else 1) * 8 / (bw * 1e6)
        pred = {"serial": step_model.combine(tc, 0.0, tm), "overlapped": step_model.combine(tc, tm, 0.0)}
        pairs.append(
            {"config": cfg, "bandwidth_mbit": bw, "n_processes": n_proc, "n_runs": len(rs), "bytes_per_step": sent}
            | {"t_compute_s": tc, "t_comm_s": tm, "measured_s": measured, "predicted_s": pred}
            | {"rel_error": {k: (v - measured) / measured for k, v in pred.items()}}
        )
    mare = (
        {k: statistics.fmean(abs(p["rel_error"][k]) for p in pairs) for k in ("serial", "overlapped")}
        if pairs
        else None
    )
    return {"skipped": False, "path": str(path), "shared_queue": shared_queue, "pairs": pairs} | {
        "mean_abs_rel_error": mare,
        "unmatched": unmatched,
    }


def check_table(check: dict) -> str:
    if check.get("skipped"):
        return f"model check skipped: {check['reason']}"
    lines = [
        f"model check against {check['path']} (shared queue: {check['shared_queue']})",
        f"{'config':<14}{'Mbit/s':>8}{'MB/step':>9}{'t_comp':>8}{'measured':>10}{'serial':>9}{'overlap':>9}",
    ]
    for p in check["pairs"]:
        pr = p["predicted_s"]
        lines.append(
            f"{p['config']:<14}{p['bandwidth_mbit']:>8g}{p['bytes_per_step'] / 1e6:>9.2f}{p['t_compute_s']:>8.3f}"
            f"{p['measured_s']:>10.3f}{pr['serial']:>9.3f}{pr['overlapped']:>9.3f}"
        )
    if check["mean_abs_rel_error"]:
        e = check["mean_abs_rel_error"]
        lines.append(
            f"mean absolute relative error: serial {100 * e['serial']:.1f}%, overlapped {100 * e['overlapped']:.1f}%"
        )
    lines += [f"unmatched: {u}" for u in check["unmatched"]]
    return "\n".join(lines)


def _short(s: str) -> str:
    return s.replace("qsdp-", "")


def table(predictions: list[dict], nodes: Sequence[int] | None = None) -> str:
    """Per model: GSPMD's modelled step (ms) and every scheme's speedup over it, as scheduled and
    with no overlap, per (bandwidth, nodes)."""
    schemes = sorted({p["scheme"] for p in predictions if p["scheme"] != "gspmd"}, key=lambda s: (s != "fp32", s))
    w = max([16] + [len(_short(s)) + 2 for s in schemes])
    lines = []
    for model in dict.fromkeys(p["model"] for p in predictions):
        sel = [p for p in predictions if p["model"] == model and (nodes is None or p["n_nodes"] in nodes)]
        by = {(p["bandwidth_gbit"], p["n_nodes"], p["scheme"]): p for p in sel}
        head = f"{'Gb/s':>6}{'nodes':>6}{'gspmd ms':>10}" + "".join(f"{_short(s):>{w}}" for s in schemes)
        lines += [f"{model}: speedup over GSPMD as scheduled (no overlap in brackets)", head, "-" * len(head)]
        for bw, n in sorted({(p["bandwidth_gbit"], p["n_nodes"]) for p in sel}):
            g = by.get((bw, n, "gspmd"))
            cells = "".join(
                f"{'-':>{w}}"
                if not (g and (bw, n, s) in by)
                else f"{by[(bw, n, s)]['speedup_vs_gspmd']:>{w - 7}.2f} ({by[(bw, n, s)]['speedup_vs_gspmd_no_overlap']:.2f})"
                for s in schemes
            )
            lines.append(f"{bw:>6g}{n:>6}{g['step_s'] * 1e3 if g else float('nan'):>10.1f}{cells}")
        lines.append("")
    lines.append(
        "A MODEL, not a measurement: the programs XLA compiled for 2 nodes, scaled (experiments.shelf.step_model);"
        " the inputs are in speedup_model.json."
    )
    return "\n".join(lines)


def plot(predictions: list[dict], path: Path, model: str = PLOT_MODEL, schemes=PLOT_SCHEMES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [p for p in predictions if p["model"] == model and p["speedup_vs_gspmd"] is not None]
    bws = sorted({p["bandwidth_gbit"] for p in sel})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, title in (
        (axes[0], "speedup_vs_gspmd", "as scheduled: max(compute, hidden) + exposed"),
        (axes[1], "speedup_vs_gspmd_no_overlap", "no overlap: compute + all communication"),
    ):
        for i, bw in enumerate(bws):
            for j, s in enumerate(schemes):
                pts = sorted((p["n_nodes"], p[key]) for p in sel if p["bandwidth_gbit"] == bw and p["scheme"] == s)
                if pts:
                    style = ("-", "--", ":", "-.")[j % 4]
                    ax.plot(
                        *zip(*pts),
                        style,
                        color=colors[i % len(colors)],
                        marker="o",
                        ms=3,
                        label=f"{_short(s)}, {bw:g} Gb/s",
                    )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({p["n_nodes"] for p in sel})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set(xlabel="nodes (8 GPUs each)", title=title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("modelled speedup over the GSPMD step")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"{model}: a MODEL from the XLA:GPU programs compiled for 2 x 8 H100", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.speedup_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--aot", type=Path, default=RESULTS / "aot.json", help="the rows of experiments.bench.aot")
    p.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(TARGETS))
    p.add_argument("--bandwidths-gbit", nargs="+", type=float, default=list(DEFAULT_BANDWIDTHS_GBIT))
    p.add_argument("--nodes", nargs="+", type=int, default=list(DEFAULT_NODES))
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--tokens-per-chip", type=float, help="default: the compiled batch (weak scaling)")
    batch.add_argument("--global-batch-tokens", type=float, help="a fixed global batch (strong scaling)")
    p.add_argument("--network-json", type=Path, default=RESULTS / "network.json")
    p.add_argument("--no-shared-queue", dest="shared_queue", action="store_false", help="check: a shaper per process")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not args.aot.exists():
        p.error(f"--aot {args.aot} does not exist (python -m experiments.bench.aot writes it)")
    return args


def main(argv=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    aot_doc = json.loads(args.aot.read_text())
    rows = target_rows(aot_doc, args.target)
    preds = predict(
        rows,
        bandwidths_gbit=args.bandwidths_gbit,
        nodes=args.nodes,
        tokens_per_chip=args.tokens_per_chip,
        global_batch_tokens=args.global_batch_tokens,
    )
    check = check_against_network(args.network_json, shared_queue=args.shared_queue)
    record = {
        "command": " ".join(["python -m experiments.bench.speedup_model", *map(shlex.quote, raw)]),
        "model": "experiments.shelf.step_model (a model, not a measurement)",
        "inputs": {
            "aot": str(args.aot.name),
            "target": args.target,
            "rows": [f"{r['model']} {r['scheme']}" for r in rows],
        }
        | {
            "bandwidths_gbit": args.bandwidths_gbit,
            "nodes": args.nodes,
            "peak_bf16_flops": TARGETS[args.target].peak_bf16_flops,
        }
        | {
            "intra_bytes_per_s": TARGETS[args.target].link_bytes_per_s,
            "aot_commands": aot_doc.get("commands"),
        },
        "predictions": preds,
        "network_check": check,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speedup_model.json").write_text(json.dumps(record, indent=1) + "\n")
    if any(p["model"] == PLOT_MODEL for p in preds):
        plot(preds, args.out / "speedup_model.png")
    print(table(preds))
    print(check_table(check))
    print(f"\nwrote {args.out / 'speedup_model.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
