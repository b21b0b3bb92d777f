"""From per-run records to what the README shows: paired gaps with intervals, the bits/accuracy
frontier as a markdown table and a PNG, and the validation curves.

Definitions (also written into ``convergence.json``):

* **Paired gap** of a configuration at seed ``s``: ``(val_q[s] - val_fp32[s]) / val_fp32[s]``,
  the relative validation-loss difference to the fp32 run of the same seed (same initial weights,
  same batches). Reported as the mean over seeds with a two-sided 95% Student t interval on
  ``n - 1`` degrees of freedom (:func:`experiments.convergence.stats.mean_interval`); none with one seed.
* **fp32 seed-to-seed spread**: sd and range (max - min) of the fp32 runs' validation losses,
  relative to their mean: the noise that pairing removes from the gaps.
* **Average wire bits per element**: ``8 * B / E``, where ``B`` is the configuration's wire bytes
  per device per step counted from its compiled step (``wire_bytes_per_step``: qsdp_jax.comm,
  ring model; codes, per-bucket scales and offsets, bucket padding and the small replicated
  leaves' fp32 mean all included) and ``E`` the elements those collectives move per device per
  step, ``E = B_fp32 / 4``: the fp32 FSDP step moves the same collectives (each sharded layer
  gathered forward and again in the rematerialised backward, its gradient reduce-scattered)
  at 4 bytes per element. So fp32 is 32, bf16 16, and a W8G8 run a little over 8. The records
  also give ``8 * B / n_params`` (wire bits per parameter per step, all collectives summed).
"""

from __future__ import annotations

import math
from pathlib import Path

from experiments.convergence import stats
from experiments.gpt.data import CORPORA  # their order in tables and plots
from experiments.convergence.runbook import CONFIGS, REFERENCE, RunKey

LEVEL = 0.95
INTERVAL_TEXT = (
    "mean over seeds of the relative validation-loss gap to the fp32 run of the same "
    "seed, with a two-sided 95% Student t interval on n-1 degrees of freedom"
)
BITS_TEXT = (
    "average wire bits per element = 8 * wire bytes per device per step / (fp32 FSDP "
    "wire bytes per device per step / 4), bytes counted from the compiled step, scales "
    "and padding included"
)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _corpus_order(records) -> list[str]:
    names = {k.corpus for k in records}
    return [c for c in CORPORA if c in names] + sorted(names - set(CORPORA))


def _config_row(name: str, recs: dict[int, dict], ref: dict[int, float], fp32_bytes: float | None) -> dict:
    val = {s: r["val_loss"] for s, r in sorted(recs.items())}
    gaps = stats.paired_relative_gaps(val, ref)
    interval = stats.mean_interval(list(gaps.values()), LEVEL) if gaps else None
    wire = _median([r["wire_bytes_per_step"] for r in recs.values()])
    n_params = next(iter(recs.values()))["n_params"]
    spec = CONFIGS.get(name)
    return {
        "name": name,
        "group": spec.group if spec else "unknown",
        "note": spec.note if spec else "",
        "qsdp": {k: v for k, v in next(iter(recs.values()))["config"]["qsdp"].items() if k != "seed"},
        "seeds": sorted(recs),
        "val_loss": {str(s): v for s, v in val.items()},
        "val_loss_mean": sum(val.values()) / len(val),
        "paired_gap": {str(s): g for s, g in gaps.items()},
        "gap": interval.as_dict() if interval else None,
        "gap_interval_contains_zero": interval.contains(0.0) if interval else None,
        "unpaired_seeds": sorted(set(recs) - set(ref)),
        "wire_bytes_per_step": wire,
        "bits_per_element": 32.0 * wire / fp32_bytes if fp32_bytes else None,
        "wire_bits_per_param": 8.0 * wire / n_params,
        "bytes_ratio_vs_fp32": fp32_bytes / wire if fp32_bytes else None,
        "nonfinite_steps": sum(r["nonfinite_steps"] for r in recs.values()),
        "wall_s_mean": sum(r["wall_s"] for r in recs.values()) / len(recs),
        "git_commits": sorted({str(r.get("git_commit")) for r in recs.values()}),
    }


def summarise(records: dict[RunKey, dict], settings: dict | None = None) -> dict:
    """``convergence.json``: per corpus, the fp32 spread and one row per configuration (per-seed
    losses and paired gaps, mean gap with its interval, wire bytes and bits per element), then
    every run, one line each."""
    corpora: dict[str, dict] = {}
    for corpus in _corpus_order(records):
        by_config: dict[str, dict[int, dict]] = {}
        for k, r in sorted(records.items()):
            if k.corpus == corpus:
                by_config.setdefault(k.config, {})[k.seed] = r
        fp = by_config.get(REFERENCE, {})
        ref = {s: r["val_loss"] for s, r in fp.items()}
        fp32_bytes = _median([r["wire_bytes_per_step"] for r in fp.values()]) if fp else None
        order = [n for n in CONFIGS if n in by_config] + sorted(set(by_config) - set(CONFIGS))
        any_rec = next(iter(next(iter(by_config.values())).values()))
        corpora[corpus] = {
            "fp32_seeds": {str(s): v for s, v in sorted(ref.items())},
            "fp32_spread": stats.spread(list(ref.values())) if ref else None,
            "fp32_wire_bytes_per_step": fp32_bytes,
            "n_params": any_rec["n_params"],
            "n_devices": any_rec["n_devices"],
            "configs": [_config_row(n, by_config[n], ref, fp32_bytes) for n in order],
        }
    runs = [
        {
            "corpus": k.corpus,
            "config": k.config,
            "seed": k.seed,
            "val_loss": r["val_loss"],
            "train_loss": r["train_loss"],
            "wire_bytes_per_step": r["wire_bytes_per_step"],
            "wall_s": r["wall_s"],
            "nonfinite_steps": r["nonfinite_steps"],
            "git_commit": r.get("git_commit"),
        }
        for k, r in sorted(records.items())
    ]
    return {
        "settings": settings,
        "interval": INTERVAL_TEXT,
        "bits_per_element": BITS_TEXT,
        "corpora": corpora,
        "runs": runs,
    }


# ----------------------------------------------------------------------------------------------
# Markdown


def pct(x: float | None, sign: bool = True) -> str:
    return "n/a" if x is None else f"{100 * x:{'+' if sign else ''}.2f}%"


def interval_cell(g: dict | None) -> str:
    """``+1.23% [+0.10%, +2.36%]`` from an ``Interval.as_dict()`` (one seed: no interval)."""
    if g is None:
        return "no paired seed"
    if g["half_width"] is None:
        return f"{pct(g['mean'])} (1 seed, no interval)"
    return f"{pct(g['mean'])} [{pct(g['low'])}, {pct(g['high'])}]"


ZERO_CELL = {True: "yes", False: "**no**", None: ""}
"""The 'CI holds 0' column: an interval excluding 0 stands out."""


def markdown_table(summary: dict, corpus: str) -> str:
    """The README table of one corpus: a line on the fp32 spread, then one row per config."""
    c = summary["corpora"][corpus]
    sp = c["fp32_spread"]
    if sp is None:
        head = f"**{corpus}**: no fp32 run yet, so no gaps."
    else:
        noise = (
            f"seed-to-seed sd {pct(sp['sd_relative'], False)}, range {pct(sp['range_relative'], False)}"
            if sp["n"] > 1
            else "one seed, no spread yet"
        )
        head = (
            f"**{corpus}**: fp32 mean validation loss {sp['mean']:.4f} over {sp['n']} seed(s); "
            f"{noise}. Gap: {INTERVAL_TEXT}."
        )
    lines = [
        head,
        "",
        "| configuration | wire bits/element | MB/step | fewer bytes | seeds | val loss | "
        "paired gap, mean [95% CI] | per-seed gaps | CI holds 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in c["configs"]:
        bits = "n/a" if r["bits_per_element"] is None else f"{r['bits_per_element']:.2f}"
        ratio = "n/a" if r["bytes_ratio_vs_fp32"] is None else f"{r['bytes_ratio_vs_fp32']:.2f}x"
        if r["name"] == REFERENCE:
            gap, per_seed, zero = "reference", "", ""
        else:
            gap = interval_cell(r["gap"])
            per_seed = ", ".join(pct(g) for g in r["paired_gap"].values())
            zero = ZERO_CELL[r["gap_interval_contains_zero"]]
        lines.append(
            f"| {r['name']} | {bits} | {r['wire_bytes_per_step'] / 1e6:.2f} | {ratio} | "
            f"{len(r['seeds'])} | {r['val_loss_mean']:.4f} | {gap} | {per_seed} | {zero} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plots


def plot_frontier(summary: dict, out: Path) -> None:
    """Mean paired gap (with its interval) against average wire bits per element, per corpus."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    corpora = list(summary["corpora"])
    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.8), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        c = summary["corpora"][corpus]
        sd = (c["fp32_spread"] or {}).get("sd_relative")
        if sd:
            ax.axhspan(-100 * sd, 100 * sd, color="0.85", label="fp32 seed sd")
        ax.axhline(0, color="k", lw=0.8)
        ax.axhline(1, color="tab:red", ls=":", lw=1, label="+1% target")
        ys = []
        for r in c["configs"]:
            if r["name"] == REFERENCE or r["gap"] is None or r["bits_per_element"] is None:
                continue
            g, x = r["gap"], r["bits_per_element"]
            err = None if g["half_width"] is None else 100 * g["half_width"]
            ys.append(abs(100 * g["mean"]) + (err or 0))
            ax.errorbar([x], [100 * g["mean"]], yerr=err, fmt="o", capsize=3, ms=5, mfc="none" if err is None else None)
            ax.annotate(r["name"], (x, 100 * g["mean"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        if not ys:
            ax.text(0.5, 0.5, "no paired run yet", transform=ax.transAxes, ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xlim(1.5, 40)
        ax.set_xticks([2, 3, 4, 6, 8, 16, 32], ["2", "3", "4", "6", "8", "16", "32"])
        if ys and max(ys) > 10:  # a +65% point next to +0.5% ones: linear to 5%, log beyond
            ax.set_yscale("symlog", linthresh=5.0)
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("average wire bits per element (weights and gradients, scales included)")
        ax.set_ylabel("validation-loss gap to paired fp32 (%)")
        ax.set_title(f"{corpus}: mean over seeds, 95% t interval", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_curves(records: dict[RunKey, dict], out: Path, seed: int | None = None) -> None:
    """Validation loss against step, one panel per corpus, for one seed (default: the lowest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = _corpus_order(records)
    if seed is None:
        seed = min(k.seed for k in records)
    fig, axes = plt.subplots(1, len(corpora), figsize=(7 * len(corpora), 4.8), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        for k, r in sorted(records.items()):
            if k.corpus != corpus or k.seed != seed or not r["val_curve"]:
                continue
            steps, _, val = zip(*r["val_curve"])
            style = "-" if k.config in (REFERENCE, "bf16") else "--"
            ax.plot(steps, val, style, marker="o", ms=3, label=k.config)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"{corpus}, seed {seed}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def frontier_points(summary: dict, corpus: str) -> list[tuple[str, float, float]]:
    """``(config, bits per element, mean gap)`` of every quantized configuration with a gap,
    the Pareto-optimal ones (no other has both fewer bits and a smaller mean gap) first."""
    pts = [
        (r["name"], r["bits_per_element"], r["gap"]["mean"])
        for r in summary["corpora"][corpus]["configs"]
        if r["name"] != REFERENCE and r["gap"] and r["bits_per_element"] is not None and math.isfinite(r["gap"]["mean"])
    ]
    front = [p for p in pts if not any(q[1] <= p[1] and q[2] < p[2] or q[1] < p[1] and q[2] <= p[2] for q in pts)]
    return sorted(front, key=lambda p: p[1]) + sorted(set(pts) - set(front), key=lambda p: p[1])
