"""The train step compiled by the real compilers (XLA:TPU, XLA:GPU) on this CPU host, side by side
with the plain GSPMD step: memory, bytes, overlap, compile time and a modelled step time.

    python -m experiments.bench.aot                                    # v5p-8, h100-8; GPT-125M
    python -m experiments.bench.aot --targets v5p-8 --models gpt-350m --schemes gspmd qsdp-W8G8

Needs the compilers, not the chips: libtpu (``pip install -e '.[aot-tpu]'``) for TPU targets,
the CUDA plugin (``'.[aot-gpu]'``) for GPU targets (``experiments.shelf.targets`` names them).
For each (target, model, scheme) the step of :mod:`experiments.bench.memory` (``gspmd`` the plain
``jax.jit`` + ``NamedSharding`` step, the others ``q.make_train_step``) is compiled for the
target's compile-only devices, one sequence per chip, with the kernels ``kernels="auto"`` would
pick on that chip (Pallas on TPU, the jnp reference on GPU). Read from the compiled program:

* **peak per chip** (``memory_analysis()``: arguments + outputs - donated + temporaries), against
  GSPMD's compiled the same way and against the chip's HBM;
* **compile seconds** on this host (a loaded 2-core machine: compare rows of one run only);
* **wire bytes per chip per step** by kind and element type (``comm_report_from_hlo`` on the
  compiler's own text), beside the analytic formula of the gathers and reduce-scatters
  (``experiments.shelf.wire_bytes.formula_bytes``; it leaves out the small leaves' all-reduce);
* **overlap** (:mod:`experiments.shelf.schedule`): per pass, the collectives with compute
  scheduled between their start and done, and their bytes;
* a **modelled step time**, labelled as a model: compute = training FLOPs (6 x parameters x
  tokens, x 8/6 with the rematerialised forward, plus attention) over the chip's peak bf16 rate;
  the step is ``max(compute, hidden comm) + exposed comm``, every collective's bytes over the
  link bandwidth (``experiments.shelf.step_model.combine``). Its inputs are printed with it.
  On a target of several nodes (``h100-16``: 2 x 8 H100; ``v5p-8x2``: two v5p slices) a
  **two-level model** for each inter-node bandwidth of the target's ``inter_gbps`` (per chip,
  one direction: one NIC per GPU; a TPU slice's data-center network): a collective whose
  replica groups span nodes (slices) moves its bytes at that bandwidth, one inside a node at
  NVLink's (ICI's) rate (a ring's slowest link sets its pace); the collectives hidden behind a
  matmul overlap the compute (``experiments.shelf.step_model``; each row keeps the
  ``collective_classes`` it reads, which ``experiments.bench.speedup_model`` scales to more nodes).

Writes ``experiments/results/aot.json`` after every row (a run resumes where it stopped: rows
already in the file are kept and not compiled again) and prints a table. The compiled texts are
kept gzipped in ``.aot_hlo/``; ``--recount`` re-reads them (a change to the byte or overlap
reading) without compiling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

# The host computes on its CPU whatever plugins are installed: an installed CUDA plugin that finds
# no GPU fails its initialisation, and then the compile-only GPU topology is "not implemented".
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.bench.memory import compile_step, peak_bytes
from experiments.shelf import schedule, step_model
from experiments.shelf.schemes import scheme_config, split_scheme
from experiments.shelf.targets import TARGETS, Target, devices
from experiments.shelf.wire_bytes import formula_bytes, gpt_collective_counts

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "aot.json"
DEFAULT_HLO = Path(__file__).resolve().parents[2] / ".aot_hlo"  # not committed (.gitignore)
MB = 1e6


def _kernels(target: Target, scheme: str) -> str | None:
    """What ``kernels="auto"`` picks on the target's own chips (None for GSPMD: no kernels)."""
    if split_scheme(scheme)[0] == "gspmd":
        return None
    return "pallas" if target.kind == "tpu" else "reference"


def model_flops(model_name: str, tokens: float) -> float:
    """Training FLOPs of one step of the GPT preset: 8 x params x tokens (forward, its
    rematerialisation, backward) plus attention's ``8 x 2 x layers x seq x d`` per token."""
    from experiments.gpt.model import GPTConfig  # imports jax: only when a row is measured

    cfg = GPTConfig.from_preset(model_name)
    d, layers, seq = cfg.d_model, cfg.n_layers, cfg.seq_len
    params = 12 * layers * d * d + cfg.vocab_size * d
    return 8.0 * params * tokens + 8.0 * 2 * layers * seq * d * tokens


def _formula(state, scheme: str, n: int) -> float | None:
    """The analytic wire bytes of the gathers and scatters (``wire_bytes.formula_bytes``) for a
    ``q.make_train_step`` scheme; None for GSPMD, whose collectives the compiler chooses."""
    if split_scheme(scheme)[0] == "gspmd":
        return None
    return formula_bytes(state.layout, scheme_config(scheme), n, *gpt_collective_counts())["total"]


def single_node_model(target: Target, flops: float, wire: float, exposed: float) -> dict:
    """The modelled step time per chip (seconds) and its inputs, every collective at the link
    rate inside the node or slice; a model, not a measurement."""
    compute = flops / target.n_chips / target.peak_bf16_flops
    return {
        "peak_bf16_flops": target.peak_bf16_flops,
        "link_bytes_per_s": target.link_bytes_per_s,
        "flops_per_chip": flops / target.n_chips,
        "compute_s": compute,
        "comm_s": wire / target.link_bytes_per_s,
        "exposed_comm_s": exposed / target.link_bytes_per_s,
        "step_s": step_model.combine(
            compute, (wire - exposed) / target.link_bytes_per_s, exposed / target.link_bytes_per_s
        ),
        "step_no_overlap_s": compute + wire / target.link_bytes_per_s,
    }


def measure(target: Target, model_name: str, scheme: str, hlo_dir: Path | None = None) -> dict:
    """One row: the step of ``model_name`` / ``scheme`` compiled for ``target``; its compiled
    text is kept gzipped in ``hlo_dir`` (so :func:`count` can be re-run without compiling)."""
    devs = devices(target)
    t0 = time.perf_counter()
    compiled, rec, state = compile_step(
        model_name, scheme, devs, 1, kernels=_kernels(target, scheme), hosts=target.hosts
    )
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        _hlo_path(hlo_dir, target.name, model_name, scheme).write_bytes(gzip.compress(text.encode()))
    cost = compiled.cost_analysis() or {}
    row = {
        "target": target.name,
        "chip": devs[0].device_kind,
        "n_chips": len(devs),
        "model": model_name,
        "scheme": scheme,
        "kernels": _kernels(target, scheme),
        "peak_bytes": peak_bytes(compiled.memory_analysis()),
        "temp_bytes": rec["temp_bytes"],
        "state_bytes": rec["state_bytes"],
        "hbm_bytes": target.hbm_bytes,
        "compile_s": compile_s,
        "tokens": rec["seq_len"] * rec["batch_per_device"] * len(devs),
        "formula_wire_bytes": _formula(state, scheme, len(devs)),
        "compiler_flops": cost.get("flops"),
        "compiler_optimal_s": cost.get("optimal_seconds"),
    }
    return count(row, text)


def count(row: dict, text: str) -> dict:
    """``row`` with what is read from its compiled text: wire bytes, overlap, modelled time."""
    from qsdp_jax import comm

    report = comm.comm_report_from_hlo(text, num_devices=row["n_chips"])
    sites = schedule.sites(text)
    wire = report.total_bytes
    hidden_share = sum(s.bytes for s in sites if s.hidden) / max(1, sum(s.bytes for s in sites))
    target = TARGETS[row["target"]]
    flops = model_flops(row["model"], row["tokens"])
    classes = step_model.collective_classes(report, sites, row["n_chips"], target.chips_per_host)
    if target.hosts > 1:
        row = {**row, "model_time_nodes": [node_model(target, flops, classes, g) for g in target.inter_gbps]}
    return {
        **row,
        "wire_bytes": wire,
        "wire_by_kind_dtype": {f"{k} {d}": b for (k, d), b in report.by_kind_dtype().items()},
        "trip_counts_known": not report.warnings,
        "overlap": schedule.summary(sites),
        "collective_classes": classes,
        "model_time": single_node_model(target, flops, wire, wire * (1 - hidden_share)),
    }


def node_model(target: Target, flops: float, classes: list[dict], gbps: float, n_chips: int | None = None) -> dict:
    """The two-level modelled step time per chip (``experiments.shelf.step_model``) at ``gbps``
    per chip between nodes, on ``n_chips`` (default: as compiled); a model, not a measurement."""
    n = n_chips or target.n_chips
    out = step_model.node_model(
        classes,
        compute_s=flops / n / target.peak_bf16_flops,
        intra_bytes_per_s=target.link_bytes_per_s,
        inter_bytes_per_s=gbps * 1e9 / 8,
        n_from=target.n_chips,
        n_to=n,
        chips_per_node=target.chips_per_host,
    )
    return {"inter_gbps": gbps, **out}


def _hlo_path(hlo_dir: Path, target: str, model: str, scheme: str) -> Path:
    return hlo_dir / f"{target}_{model}_{scheme}.hlo.gz"


def _scheme_width(rows: list[dict]) -> int:
    return max([20] + [len(r["scheme"]) + 2 for r in rows])


def table(rows: list[dict]) -> str:
    """One line per row; ``vs gspmd`` is the peak over the GSPMD row of the same target and model."""
    base = {(r["target"], r["model"]): r["peak_bytes"] for r in rows if r["scheme"] == "gspmd"}
    w = _scheme_width(rows)
    head = (
        f"{'target':<8}{'chip':<22}{'model':<16}{'scheme':<{w}}{'peak MB':>9}{'vs gspmd':>9}{'HBM':>6}"
        f"{'compile s':>10}{'wire MB':>9}{'formula':>9}{'hidden':>8}{'model ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = base.get((r["target"], r["model"]))
        vs = f"{r['peak_bytes'] / ref:.2f}x" if ref else "-"
        fits = "fits" if r["peak_bytes"] <= r["hbm_bytes"] else "OVER"
        ov = list(r["overlap"].values())
        hidden = f"{sum(o['hidden'] for o in ov)}/{sum(o['collectives'] for o in ov)}"
        form = "-" if r["formula_wire_bytes"] is None else f"{r['formula_wire_bytes'] / MB:.1f}"
        lines.append(
            f"{r['target']:<8}{r['chip'][:21]:<22}{r['model']:<16}{r['scheme']:<{w}}{r['peak_bytes'] / MB:>9.1f}"
            f"{vs:>9}{fits:>6}{r['compile_s']:>10.1f}{r['wire_bytes'] / MB:>9.1f}{form:>9}{hidden:>8}"
            f"{r['model_time']['step_s'] * 1e3:>9.2f}"
        )
    lines += [
        "",
        "MB = 1e6 B per chip, one 1024-token sequence per chip. peak: memory_analysis() of the program the real compiler",
        "built (arguments + outputs - donated + temporaries); HBM: fits the chip's memory or not. wire: bytes per chip",
        "per step from the compiled text (comm_report); formula: the gathers' and reduce-scatters' analytic bytes",
        "(no all-reduce). hidden: collectives with a matmul scheduled between start and done / all collectives.",
        "model ms: a MODEL, not a measurement: max(training FLOPs per chip / peak bf16 rate, hidden bytes / link",
        "bandwidth) + bytes of the collectives not hidden / link bandwidth (the inputs are in the JSON, model_time).",
    ]
    return "\n".join(lines)


def overlap_table(rows: list[dict]) -> str:
    """Per row and pass: collectives, how many are asynchronous, how many hide behind compute."""
    w = _scheme_width(rows)
    head = f"{'target':<8}{'model':<16}{'scheme':<{w}}{'pass':<15}{'collectives':>12}{'async':>7}{'hidden':>8}{'MB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        for name, o in r["overlap"].items():
            lines.append(
                f"{r['target']:<8}{r['model']:<16}{r['scheme']:<{w}}{name:<15}{o['collectives']:>12}{o['async']:>7}"
                f"{o['hidden']:>8}{o['bytes'] / MB:>9.1f}"
            )
    return "\n".join(lines)


def nodes_table(rows: list[dict]) -> str:
    """The two-level model's rows (targets of several nodes): per inter-node bandwidth, the
    step and its parts, and the ratio to GSPMD's at the same bandwidth."""
    base = {
        (r["target"], r["model"], m["inter_gbps"]): m["step_s"]
        for r in rows
        if r["scheme"] == "gspmd"
        for m in r.get("model_time_nodes", [])
    }
    w = _scheme_width(rows)
    head = (
        f"{'target':<9}{'model':<16}{'scheme':<{w}}{'Gb/s':>6}{'inter MB':>10}{'intra MB':>10}"
        f"{'compute ms':>11}{'hidden ms':>10}{'exposed ms':>11}{'step ms':>9}{'vs gspmd':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for m in r.get("model_time_nodes", []):
            ref = base.get((r["target"], r["model"], m["inter_gbps"]))
            vs = f"{m['step_s'] / ref:.2f}x" if ref else "-"
            lines.append(
                f"{r['target']:<9}{r['model']:<16}{r['scheme']:<{w}}{m['inter_gbps']:>6}"
                f"{m['inter_bytes'] / MB:>10.1f}{m['intra_bytes'] / MB:>10.1f}{m['compute_s'] * 1e3:>11.2f}"
                f"{m['hidden_comm_s'] * 1e3:>10.2f}{m['exposed_comm_s'] * 1e3:>11.2f}{m['step_s'] * 1e3:>9.2f}{vs:>9}"
            )
    lines += [
        "",
        "A MODEL, not a measurement: per chip, bytes between nodes (GPU: one NIC per GPU; TPU: slices over the",
        "data-center network) at the stated Gb/s, one direction; inside a node (slice) at NVLink's 450 GB/s (v5p",
        "ICI: 600 GB/s); compute = training FLOPs / peak bf16; step = max(compute, comm hidden behind a matmul",
        "in the schedule) + exposed comm.",
    ]
    return "\n".join(lines)


def _key(row: dict) -> tuple[str, str, str]:
    return row["target"], row["model"], row["scheme"]


def _write(out: Path, commands: list[str], rows: list[dict]):
    """The rows and every command that made them (``command``: them joined, for the docs)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "; ".join(commands), "commands": commands, "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=["v5p-8", "h100-8"], choices=sorted(TARGETS))
    p.add_argument("--models", nargs="+", default=["gpt-125m"])
    p.add_argument("--schemes", nargs="+", default=["gspmd", "fp32", "qsdp-W8G8"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--fresh", action="store_true", help="start a new file instead of resuming the rows in --out")
    p.add_argument("--hlo-dir", type=Path, default=DEFAULT_HLO, help="where the compiled texts are kept (gzipped)")
    p.add_argument(
        "--recount", action="store_true", help="re-read the kept texts of the rows in --out, compile nothing"
    )
    args = p.parse_args(argv)
    old = {"rows": [], "commands": []} if args.fresh or not args.out.exists() else json.loads(args.out.read_text())
    rows, commands = old["rows"], old.get("commands", [old["command"]] if "command" in old else [])
    if args.recount:  # the rows in --out read again from their kept texts; nothing compiled
        rows = [count(r, gzip.decompress(_hlo_path(args.hlo_dir, *_key(r)).read_bytes()).decode()) for r in rows]
    elif (
        cmd := " ".join(["python -m experiments.bench.aot", *(argv if argv is not None else sys.argv[1:])])
    ) not in commands:
        commands.append(cmd)
    done = {_key(r) for r in rows}
    for target in [] if args.recount else args.targets:
        for model in args.models:
            for scheme in args.schemes:
                if (target, model, scheme) in done:
                    continue
                r = measure(TARGETS[target], model, scheme, args.hlo_dir)
                print(
                    f"  {target} {model} {scheme}: peak {r['peak_bytes'] / MB:.1f} MB, {r['compile_s']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(r)
                _write(args.out, commands, rows)
    _write(args.out, commands, rows)
    print(table(rows))
    print()
    print(overlap_table(rows))
    if any("model_time_nodes" in r for r in rows):
        print()
        print(nodes_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
