"""Convergence of QSDP against fp32 FSDP, with seeds, intervals and two corpora.

    python -m experiments.convergence --plan                  # what is done, what is left, ETA
    python -m experiments.convergence --max-runs 20           # train the next 20 runs, then report
    python -m experiments.convergence --corpus kjv --only fp32 qsdp-sr-W4G4 --seeds 0 1 2
    python -m experiments.convergence --group frontier        # the frontier slots (+ fp32)
    python -m experiments.convergence --report                # rewrite the summary from the records

Trains the byte-level GPT through the real sharded step (``experiments.gpt.trainer``) for every
``(corpus, configuration, seed)`` asked (default: both corpora, seeds 0 1 2, the reference and
main configurations of :data:`experiments.convergence.runbook.CONFIGS`). A seed sets the initial weights, the
data order and the quantization noise; every gap is against the fp32 run of the same seed.

Resumable per run: each finished run writes a small JSON record under
``<out>/convergence_runs/<corpus>/<config>/seed<s>.json`` (committed; see runbook.py) and is
skipped next time; ``--max-runs`` / ``--max-minutes`` bound a chunk to fit a session. After
training (and with ``--report``) it writes, from every record made with the same settings,
``<out>/convergence.json`` (per-seed runs, per-configuration mean paired gap with its 95% Student
t interval, fp32 seed spread, wire bits per element), ``<out>/convergence_frontier.md`` (the
README tables), ``<out>/convergence_frontier.png`` and ``<out>/convergence.png`` (validation
curves of the first seed). Definitions: :mod:`experiments.convergence.frontier`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.convergence import frontier, levers, runbook
from experiments.gpt import data
from experiments.gpt.data import CORPORA
from experiments.gpt.devices import simulate_cpu_devices

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.convergence", description=__doc__.split("\n\n")[0])
    d = runbook.Settings()
    s = p.add_argument_group("settings shared by every run (records with others are refused)")
    s.add_argument("--preset", default=d.preset)
    s.add_argument("--steps", type=int, default=d.steps)
    s.add_argument("--batch", type=int, default=d.batch)
    s.add_argument("--seq-len", type=int, default=d.seq_len)
    s.add_argument("--lr", type=float, default=d.lr)
    s.add_argument("--warmup", type=int, default=d.warmup)
    s.add_argument("--eval-every", type=int, default=d.eval_every)
    s.add_argument("--eval-batches", type=int, default=d.eval_batches)
    s.add_argument("--devices", type=int, default=d.devices)
    w = p.add_argument_group("which runs")
    w.add_argument("--corpus", nargs="+", choices=CORPORA, default=list(CORPORA))
    w.add_argument("--seeds", nargs="+", type=int, default=list(runbook.DEFAULT_SEEDS))
    w.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="CONFIG",
        help="configurations to run (fp32 is always added: it is the pairing)",
    )
    w.add_argument(
        "--group",
        nargs="+",
        default=None,
        choices=runbook.GROUPS,
        help="configuration groups (default: reference and main)",
    )
    w.add_argument("--max-runs", type=int, default=None, help="train at most N runs, then report")
    w.add_argument(
        "--max-minutes", type=float, default=None, help="start no run that the estimate says would end after M minutes"
    )
    m = p.add_argument_group("mode")
    m.add_argument("--plan", action="store_true", help="print done / left / estimate; train nothing")
    m.add_argument("--report", action="store_true", help="write the summary from the records; train nothing")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> runbook.Settings:
    return runbook.Settings(
        preset=args.preset,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        devices=args.devices,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        configs = runbook.select_configs(args.only, args.group)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, v in (("--max-runs", args.max_runs), ("--max-minutes", args.max_minutes)):
        if v is not None and v <= 0:
            print(f"error: {name} {v} must be positive", file=sys.stderr)
            return 2
    settings = settings_from(args)
    root = args.out / "convergence_runs"
    records = runbook.load_records(root) if root.exists() else {}
    keys = runbook.run_keys(args.corpus, configs, sorted(set(args.seeds)))
    the_plan = runbook.plan(keys, records, settings)
    if args.plan:
        print(the_plan.text(root, args.max_runs, args.max_minutes))
        return 0
    if the_plan.conflicts and not args.report:
        print(the_plan.text(root), file=sys.stderr)
        print(
            "error: records made with other settings are in the way; move them (or choose "
            "another --out) so that runs of different settings are never mixed",
            file=sys.stderr,
        )
        return 2
    if not args.report:
        train_chunk(the_plan, settings, root, args.max_runs, args.max_minutes)
        records = runbook.load_records(root)
    return report(records, settings, args.out)


def train_chunk(
    the_plan: runbook.Plan, settings: runbook.Settings, root: Path, max_runs: int | None, max_minutes: float | None
) -> int:
    """Train the plan's runs in order until done, ``max_runs`` or the ``max_minutes`` budget."""
    todo = the_plan.todo[:max_runs] if max_runs is not None else the_plan.todo
    if not todo:
        print("nothing left to train for these runs", flush=True)
        return 0
    simulate_cpu_devices(settings.devices)
    import jax  # after XLA_FLAGS

    import qsdp_jax as q
    from experiments.gpt.trainer import RunConfig, train  # imports jax: after simulate_cpu_devices

    devices = jax.devices()[: settings.devices]
    if len(devices) < settings.devices:
        raise SystemExit(
            f"error: --devices {settings.devices}, but jax has {len(devices)} device(s) "
            "in this process (the count is fixed when jax is first imported)"
        )
    commit = runbook.git_commit()
    t0, per_run, times = time.perf_counter(), the_plan.seconds_per_run, []
    for i, key in enumerate(todo):
        elapsed = time.perf_counter() - t0
        if max_minutes is not None and elapsed + per_run > 60 * max_minutes:
            print(
                f"stopping: the next run would end after --max-minutes {max_minutes:g} "
                f"({elapsed:.0f} s spent, ~{per_run:.0f} s per run)",
                flush=True,
            )
            break
        spec = runbook.CONFIGS[key.config]
        run = RunConfig(
            qsdp=q.QSDPConfig(**spec.qsdp, seed=key.seed),
            preset=settings.preset,
            steps=settings.steps,
            batch_size=settings.batch,
            seq_len=settings.seq_len,
            lr=settings.lr,
            warmup=settings.warmup,
            seed=key.seed,
            eval_every=settings.eval_every,
            eval_batches=settings.eval_batches,
            data_path=str(data.corpus_text_path(key.corpus)),
            **dict(spec.run),
        )
        print(f"[{i + 1}/{len(todo)} {key}] training {settings.steps} steps ...", flush=True)

        def on_step(log, key=key):
            if log.val_loss is not None:
                print(f"[{key}] step {log.step} loss {log.loss:.4f} val {log.val_loss:.4f}", flush=True)

        t_run = time.perf_counter()
        result = train(run, on_step=on_step, devices=devices)
        record = runbook.compact_record(result.as_dict(), key, settings, commit)
        path = runbook.write_record(root, key, record)
        times.append(time.perf_counter() - t_run)
        per_run = sum(times) / len(times)  # this chunk's own pace from now on
        print(f"[{key}] val {result.val_loss:.4f} in {result.wall_s:.0f} s -> {path}", flush=True)
    print(f"trained {len(times)} run(s); {len(the_plan.todo) - len(times)} left of this plan", flush=True)
    return len(times)


def report(records: dict, settings: runbook.Settings, out: Path) -> int:
    """Write convergence.json, the markdown tables and both plots from the records made with
    ``settings``; print the tables."""
    same = {k: r for k, r in records.items() if r.get("settings") == settings.as_dict()}
    if not same:
        print("no records with these settings yet: nothing to report", flush=True)
        return 0
    summary = levers.add_levers(frontier.summarise(same, settings.as_dict()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(summary, indent=1) + "\n")
    tables = "\n\n".join(
        t
        for c in summary["corpora"]
        for t in (frontier.markdown_table(summary, c), levers.markdown_table(summary, c))
        if t
    )
    (out / "convergence_frontier.md").write_text(tables + "\n")
    frontier.plot_frontier(summary, out / "convergence_frontier.png")
    frontier.plot_curves(same, out / "convergence.png")
    print(tables)
    print(
        f"\nwrote {out}/convergence.json, convergence_frontier.md, convergence_frontier.png, convergence.png",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
