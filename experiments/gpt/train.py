"""Train the byte-level GPT with QSDP (or an FSDP baseline) on the devices JAX finds.

    python -m experiments.gpt.train                          # tiny model, QSDP W8G8, 300 steps
    python -m experiments.gpt.train --fp32                   # the fp32 FSDP baseline
    python -m experiments.gpt.train --weight-bits 4 --grad-bits 4 --preset small --steps 1000
    python -m experiments.gpt.train --weight-mode comm --weight-bits 8 --grad-bits none
    python -m experiments.gpt.train --mesh node=2,local=4 --inter-grad-bits 4   # two levels

Devices: the GPUs or TPUs of this host (all processes' with several processes), else the CPU
with ``--devices`` (default 8) simulated devices; ``--simulate-devices N`` forces simulated CPU
devices anywhere. Several processes (SLURM ``srun``, a TPU pod, or ``--coordinator``
``--num-processes`` ``--process-id`` / ``QSDP_*`` variables) start ``jax.distributed`` first;
each process then loads only its own rows of every batch, and only process 0 prints and writes.

Writes ``config.json``, ``metrics.jsonl`` (one line per step, appended as training goes),
``summary.json`` and ``loss.png`` to the output directory, and prints a summary (losses,
tokens/s, wire bytes per step by collective, bytes relative to fp32 FSDP).

The number of simulated devices must be known before jax starts its backends, so this module
imports nothing that uses jax at the top: :func:`run_cli` sets ``XLA_FLAGS`` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path

from experiments.gpt import data as textdata
from experiments.gpt.args import CLIError, build_parser
from experiments.gpt.devices import describe_devices
from experiments.gpt.files import dumps_strict, write_atomic
from experiments.gpt.report import Progress, _num, plot_loss, summary_text
from experiments.gpt.run_files import MetricsLog, RunCheckpoints, Stopped, StopSignals, open_checkpoints, resume_step
from experiments.gpt.setup import finish_peers, fp32_wire_bytes, prepare_run


def _set_up_trainer(args, devices, cfg, run):
    """The Trainer for ``run`` (compiles nothing yet); CLIError when the data cannot feed it."""
    from qsdp_jax import distributed  # imports jax: after prepare_run set the device flags

    from experiments.gpt import trainer as tr  # imports jax, likewise

    if not args.quiet:
        distributed.main_print(
            f"{cfg.name}: setting up on {describe_devices(devices)}"
            + (f", mesh {dict(run.mesh)}" if run.mesh else "")
            + " and compiling the train step ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        trainer = tr.Trainer(run, devices)
        # Evaluation batches are drawn lazily by the trainer: check the split holds one now.
        seq = trainer.model.cfg.seq_len
        textdata.eval_batches(trainer.dataset.val, run.batch_size, seq, run.eval_batches)
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"cannot set up the run: {e}") from None
    return trainer


def _run_config(args, devices, cfg, run, trainer) -> dict:
    """What ``config.json`` records about the run."""
    config = run.as_dict()
    config.update(
        name=cfg.name,
        model=dataclasses.asdict(trainer.model.cfg),
        n_params=trainer.model.count_params(),
        n_devices=trainer.n_devices,
        data_source=trainer.dataset.source,
        argv=list(getattr(args, "argv", None) or []),
        devices=describe_devices(devices),
    )
    return config


def _fp32_bytes(args, cfg, trainer, report):
    """Wire bytes per step of fp32 FSDP (None when ``--no-fp32-ratio`` skips compiling it)."""
    if cfg.weight_bits is None and cfg.grad_bits is None and cfg.fp_comm_dtype == "float32":
        return report.total_bytes
    return None if args.no_fp32_ratio else fp32_wire_bytes(trainer)


def _write_results(args, cfg, out, summary, history, report, trainer, print_summary) -> None:
    """Process 0's ``summary.json``, ``loss.png`` and printed summary."""
    write_atomic(out / "summary.json", dumps_strict(summary, indent=1) + "\n")
    model = trainer.model.cfg
    plot_loss(history, out / "loss.png", f"{cfg.name}: GPT d{model.d_model} L{model.n_layers} on {summary['devices']}")
    if print_summary:
        if args.quiet:
            print(
                f"{cfg.name}: train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}, "
                f"{_num(summary['wire_bytes_per_step'])}/step; wrote {out}"
            )
        else:
            print(summary_text(summary, report.table()))


def _watchdog(trainer, ckpts, timeout_s):
    """A StepWatchdog whose save attempt writes a checkpoint of the trainer's state."""
    from qsdp_jax.watchdog import StepWatchdog, save_or_explain  # imports jax

    def try_save():
        if ckpts is None:
            return "No --checkpoint-dir: nothing saved"
        return save_or_explain(
            lambda: ckpts.save(trainer, force=True) and ckpts.ckpt.wait(), trainer.state, ckpts.latest_step
        )

    return StepWatchdog(timeout_s, on_timeout=try_save, what="the trainer")


def train_loop(
    trainer,
    out: Path,
    start: int,
    progress,
    ckpts: RunCheckpoints | None,
    failure_timeout: float | None = None,
    write_metrics: bool = True,
    max_skipped: int = 0,
) -> list:
    """Train from ``start`` to the end, streaming metrics and saving checkpoints; the full
    history (earlier rows of a resumed run included). Raises :class:`Stopped` on SIGTERM/SIGINT
    to any process (every process stops after the same step, :class:`qsdp_jax.distributed.StopVote`)
    after saving, and after ``max_skipped`` steps in a row that skipped their update (0: never).
    With ``failure_timeout``, a :class:`qsdp_jax.watchdog.StepWatchdog` ends the process
    (status 75) when no step finishes for that long or a collective fails."""
    import jax  # after prepare_run set the device flags

    from experiments.gpt.trainer import StepLog  # imports jax, likewise
    from qsdp_jax.distributed import StopVote

    log = MetricsLog(out / "metrics.jsonl", start, write=write_metrics)  # process 0 writes
    history = [StepLog(**r) for r in log.rows]
    dog = _watchdog(trainer, ckpts, failure_timeout) if failure_timeout is not None else None
    vote, why, signame, skipped = StopVote(), None, None, 0  # every process stops after one step
    with StopSignals() as stop, dog or contextlib.nullcontext():
        try:
            steps = trainer.steps()
            while True:
                try:
                    entry = next(steps)
                except StopIteration:
                    break
                except jax.errors.JaxRuntimeError as e:
                    if dog is None:
                        raise
                    dog.fail(e)
                if dog is not None:
                    dog.beat(entry.step)
                history.append(entry)
                log.append(dataclasses.asdict(entry))
                progress.update(entry)
                if ckpts is not None:
                    ckpts.save(trainer)
                skipped = skipped + 1 if entry.nonfinite else 0
                why = vote.check(entry.step, stop.received)
                signame = vote.decision.reason if why is not None and vote.decision is not None else None
                why = why or _all_skipped(skipped, max_skipped)
                if why is not None:
                    break
        except BaseException:
            if progress.tty and progress.enabled:
                sys.stderr.write("\n")
            print(
                f"training stopped at step {len(history)}/{trainer.run.steps}; the metrics so far "
                f"are in {out / 'metrics.jsonl'}",
                file=sys.stderr,
            )
            raise
        finally:
            log.close()
        if ckpts is not None:
            ckpts.finish(trainer)
    finish_peers()  # the collectives are over: this process may exit before the others
    if why is not None:
        raise _stopped(why, signame, int(trainer.state.step), trainer.run.steps, ckpts)
    return history


def _all_skipped(skipped: int, max_skipped: int) -> str | None:
    """Why the run stops after ``skipped`` steps in a row without an update, or None."""
    if not max_skipped or skipped < max_skipped:
        return None
    return (
        f"the last {skipped} steps all had non-finite gradients and skipped their update "
        f"(--max-skipped-steps {max_skipped}): the run is not training; lower --lr or check the data"
    )


def _stopped(why: str, signame: str | None, step: int, steps: int, ckpts: RunCheckpoints | None) -> Stopped:
    """The Stopped of a run that ends early: 128 + the signal ``signame`` (the vote's), else 1."""
    where = (
        f"saved checkpoint {ckpts.directory}/{step}; continue with --resume"
        if ckpts is not None
        else "no --checkpoint-dir: the weights are not saved"
    )
    if signame is None:
        return Stopped(f"stopped at step {step}/{steps}: {why}; {where}", 1)
    return Stopped(f"{why} at step {step}/{steps}: {where}", 128 + int(signal.Signals[signame]))


def run_cli(args, *, print_summary: bool = True):
    """Run the training the flags describe; returns the RunResult. CLIError on bad flags or
    environment, before anything is written."""
    devices, main, cfg, run, out = prepare_run(args)
    from experiments.gpt import trainer as tr  # imports jax: after prepare_run set the device flags

    t_start = time.perf_counter()
    trainer = _set_up_trainer(args, devices, cfg, run)
    if main:  # only process 0 writes the run's files
        out.mkdir(parents=True, exist_ok=True)
    ckpts = open_checkpoints(args, out)
    start = resume_step(ckpts, trainer, args) if ckpts is not None else 0
    if main:
        config = _run_config(args, devices, cfg, run, trainer)
        write_atomic(out / "config.json", dumps_strict(config, indent=1) + "\n")

    t_compile = time.perf_counter()
    report = trainer.wire_report()  # compiles the step (the first step then reuses it)
    compile_s = time.perf_counter() - t_compile
    fp32_bytes = _fp32_bytes(args, cfg, trainer, report)

    setup_s = time.perf_counter() - t_start
    progress = Progress(run.steps, run.batch_size * trainer.model.cfg.seq_len, enabled=not args.quiet and main)
    history = train_loop(
        trainer,
        out,
        start,
        progress,
        ckpts,
        args.failure_timeout,
        write_metrics=main,
        max_skipped=args.max_skipped_steps,
    )

    result = tr.summarise(trainer, history, report, time.perf_counter() - t_start, compile_s)
    summary = {k: v for k, v in result.as_dict().items() if k != "history"}
    summary.update(
        name=cfg.name,
        steps=run.steps,
        out_dir=str(out),
        setup_s=setup_s,
        fp32_wire_bytes_per_step=fp32_bytes,
        bytes_ratio_vs_fp32=(fp32_bytes / report.total_bytes) if fp32_bytes and report.total_bytes else None,
        devices=describe_devices(devices),
        mesh=dict(trainer.mesh.shape),
        wire_bytes_by_axis=report.by_axis(trainer.mesh),
    )
    if cfg.bit_policy:
        summary["bit_policy"] = {
            "rules": "; ".join(f"{p}={str(w).lower()},{str(g).lower()}" for p, w, g in cfg.bit_policy),
            "table": trainer.state.layout.bits_table(cfg),
        }
    if main:
        _write_results(args, cfg, out, summary, history, report, trainer, print_summary)
    return result


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2), already reported by argparse
        return int(e.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run_cli(args)
    except CLIError as e:
        try:
            parser.error(str(e))
        except SystemExit as exit_:
            return int(exit_.code or 0)  # parser.error exits with 2
    except KeyboardInterrupt:
        return 130
    except Stopped as e:
        print(str(e), file=sys.stderr)
        return e.code
    return 0


def cli() -> int:
    """:func:`main` for ``python -m``: after a run that succeeded, also stop ``jax.distributed``
    and process 0's coordination-service helper (``qsdp_jax.distributed.shutdown``), so that the
    coordinator's port is free at once for the next run; left running, the helper holds it for
    the heartbeat timeout + 10 s. Not after a failure: its shutdown barrier would wait for peers
    that may be gone. (Not in :func:`main`, which tests and workers call more than once in one
    process.)"""
    code = main()
    if code == 0:
        from qsdp_jax import distributed

        try:
            distributed.shutdown()
        except Exception as e:  # noqa: BLE001 - the run is done and written: say so, exit 0
            print(f"qsdp_jax: jax.distributed did not shut down cleanly: {type(e).__name__}: {e}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(cli())
