"""Does a lever help? The paired difference of two configurations' gaps, seed by seed.

A configuration's gap at seed ``s`` is ``(val[s] - fp32[s]) / fp32[s]`` (experiments.convergence.frontier).
For a lever ``A`` against its base ``B`` (``runbook.LEVERS``), the difference at seed ``s`` is
``gap_A[s] - gap_B[s] = (val_A[s] - val_B[s]) / fp32[s]``: both runs of a seed start from the same
weights and see the same batches, so the fp32 run's own luck (which moves every gap of its seed
alike) cancels, and what is left is the two configurations' quantization noise. Reported over
the seeds both have (and fp32 has) as a mean with a two-sided 95% Student t interval, in
points of relative validation loss; negative = the lever lowers the loss.
"""

from __future__ import annotations

from experiments.convergence import stats
from experiments.convergence.frontier import LEVEL, ZERO_CELL, pct, interval_cell
from experiments.convergence.runbook import LEVERS


def lever_rows(corpus_summary: dict, levers=LEVERS) -> list[dict]:
    """One row per lever whose configuration and base share at least one paired seed."""
    gaps = {r["name"]: {int(s): g for s, g in r["paired_gap"].items()} for r in corpus_summary["configs"]}
    rows = []
    for name, base, what in levers:
        a, b = gaps.get(name, {}), gaps.get(base, {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        diffs = {s: a[s] - b[s] for s in seeds}
        interval = stats.mean_interval(list(diffs.values()), LEVEL)
        rows.append(
            {
                "config": name,
                "base": base,
                "lever": what,
                "seeds": seeds,
                "difference": {str(s): d for s, d in diffs.items()},
                "mean": interval.as_dict(),
                "interval_contains_zero": interval.contains(0.0),
            }
        )
    return rows


def add_levers(summary: dict, levers=LEVERS) -> dict:
    """``summary`` (experiments.convergence.frontier.summarise) with ``levers`` rows under every corpus."""
    for c in summary["corpora"].values():
        c["levers"] = lever_rows(c, levers)
    return summary


def markdown_table(summary: dict, corpus: str) -> str:
    """The README table of one corpus's lever rows ('' when there are none)."""
    rows = summary["corpora"][corpus].get("levers") or []
    if not rows:
        return ""
    lines = [
        f"**{corpus}, levers**: paired difference of the gaps, lever minus base, same seeds "
        "(negative: the lever lowers the validation loss).",
        "",
        "| configuration | against | lever | seeds | difference, mean [95% CI] | per seed | CI holds 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(pct(d) for d in r["difference"].values())
        lines.append(
            f"| {r['config']} | {r['base']} | {r['lever']} | {len(r['seeds'])} | "
            f"{interval_cell(r['mean'])} | {per_seed} | {ZERO_CELL[r['interval_contains_zero']]} |"
        )
    return "\n".join(lines)
