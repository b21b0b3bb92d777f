"""Train the byte-level GPT with QSDP (or an FSDP baseline) on simulated CPU devices.

    python -m experiments.train_gpt                          # tiny model, QSDP W8G8, 300 steps
    python -m experiments.train_gpt --fp32                   # the fp32 FSDP baseline
    python -m experiments.train_gpt --weight-bits 4 --grad-bits 4 --preset small --steps 1000
    python -m experiments.train_gpt --weight-mode comm --weight-bits 8 --grad-bits none

Writes ``config.json``, ``metrics.jsonl`` (one line per step, appended as training goes),
``summary.json`` and ``loss.png`` to the output directory, and prints a summary (losses,
tokens/s, wire bytes per step by collective, bytes relative to fp32 FSDP).

The number of simulated devices (``--devices``) must be known before jax is imported, so this
module imports nothing that uses jax at the top: :func:`run_cli` sets ``XLA_FLAGS`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from experiments.devices import simulate_cpu_devices
from experiments.run_files import Stopped, open_checkpoints, resume_step, train_loop

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNS_DIR = REPO_ROOT / "runs"
PRESETS = ("tiny", "small", "medium")
ARTIFACTS = ("config.json", "metrics.jsonl", "summary.json", "loss.png")


class CLIError(Exception):
    """A bad flag, flag combination or environment; reported as an argparse error (exit 2)."""


# ----------------------------------------------------------------------------------------------
# Arguments


def _bits(text: str):
    if text.strip().lower() in ("none", "fp", "full"):
        return "none"
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 1..8 or 'none', got {text!r}") from None
    if not 1 <= v <= 8:
        raise argparse.ArgumentTypeError(f"expected an integer 1..8 or 'none', got {v}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.train_gpt",
        usage="%(prog)s [options]   (--help for the list)",
        description="Train the byte-level GPT with QSDP (quantized FSDP) or an FSDP baseline, "
        "through the real sharded train step, on simulated CPU devices.",
        epilog="Baselines: --fp32 (FSDP, fp32 collectives), --bf16 (FSDP, bf16 collectives). "
        "Default: QSDP W8G8 (weights on a randomly shifted 8-bit grid, 8-bit gradients).",
    )
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=PRESETS, default="tiny", help="model size (default: tiny)")
    m.add_argument("--d-model", type=_positive, help="override the preset's width")
    m.add_argument("--n-layers", type=_positive, help="override the preset's depth")
    m.add_argument("--n-heads", type=_positive, help="override the preset's number of heads")
    m.add_argument("--seq-len", type=_positive, help="override the preset's context length")

    t = p.add_argument_group("training")
    t.add_argument("--steps", type=_positive, default=300, help="training steps (default: 300)")
    t.add_argument("--batch", type=_positive, default=16,
                   help="global batch size in sequences, a multiple of --devices (default: 16)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    t.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning-rate schedule after warmup (default: cosine)")
    t.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps (default: 30, or steps // 10 if that is smaller)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights, data order and quantization noise (default: 0)")
    t.add_argument("--eval-every", type=_positive, default=None,
                   help="validate every N steps and at the end (default: steps // 5)")
    t.add_argument("--eval-batches", type=_positive, default=8,
                   help="validation batches per evaluation (default: 8)")
    t.add_argument("--data", default=None, help="a UTF-8 text file to train on (default: Shakespeare)")

    qz = p.add_argument_group("quantization / communication")
    qz.add_argument("--weight-bits", type=_bits, default=None, metavar="{1..8,none}",
                    help="bits per weight on the all-gather (default: 8; none with --weight-mode full)")
    qz.add_argument("--grad-bits", type=_bits, default=None, metavar="{1..8,none}",
                    help="bits per gradient on the reduce-scatter (default: 8)")
    qz.add_argument("--bucket-size", type=_positive, default=1024,
                    help="elements per quantization bucket, a multiple of 8 (default: 1024)")
    qz.add_argument("--min-shard-size", type=int, default=4096,
                    help="leaves smaller than this stay replicated in full precision (default: 4096)")
    qz.add_argument("--weight-mode", choices=("qsdp", "comm", "full"), default=None,
                    help="qsdp: weights kept on a shifted grid (default); comm: quantized only "
                    "for the all-gather (ZeRO++-style); full: full-precision gather")
    qz.add_argument("--weight-rounding", choices=("shift", "stochastic"), default="shift",
                    help="how qsdp mode puts updated weights on a grid (default: shift)")
    qz.add_argument("--comm-dtype", choices=("float32", "bfloat16"), default=None,
                    help="dtype of the unquantized collectives (default: float32)")
    base = qz.add_mutually_exclusive_group()
    base.add_argument("--fp32", action="store_true",
                      help="the fp32 FSDP baseline (weight/grad bits none, mode full, fp32 comm)")
    base.add_argument("--bf16", action="store_true",
                      help="the bf16 FSDP baseline (weight/grad bits none, mode full, bf16 comm)")

    o = p.add_argument_group("environment / output")
    o.add_argument("--devices", type=_positive, default=8,
                   help="number of simulated CPU devices (default: 8)")
    o.add_argument("--out", type=Path, default=None,
                   help="output directory (default: runs/<preset>-<config>-<timestamp>)")
    o.add_argument("--overwrite", action="store_true",
                   help="replace this tool's files in an existing non-empty output directory")
    o.add_argument("--no-fp32-ratio", action="store_true",
                   help="skip compiling the fp32 step for the bytes-vs-fp32 ratio")
    o.add_argument("--quiet", action="store_true",
                   help="no progress line; a one-line summary instead of the full one")

    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where checkpoints go (default: <out>/checkpoints when --checkpoint-every "
                   "or --resume is given)")
    c.add_argument("--checkpoint-every", type=_positive, default=None,
                   help="save every N steps, asynchronously (and always on SIGTERM/SIGINT and at the end)")
    c.add_argument("--keep", type=_positive, default=3, help="complete checkpoints kept (default: 3)")
    c.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint (start fresh when there is none); "
                   "metrics continue the same metrics.jsonl")
    c.add_argument("--failure-timeout", type=float, default=None, metavar="S",
                   help="exit (status 75, after trying to save) when no step finishes for S seconds "
                   "or a collective fails, e.g. a peer process died (default: off; 60 is a good bound "
                   "for multi-process runs)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def qsdp_kwargs(args: argparse.Namespace) -> dict:
    """QSDPConfig keyword arguments from the flags; CLIError on a contradictory combination."""
    wbits, gbits, mode, dtype = args.weight_bits, args.grad_bits, args.weight_mode, args.comm_dtype
    if args.fp32 or args.bf16:
        flag = "--fp32" if args.fp32 else "--bf16"
        want = "float32" if args.fp32 else "bfloat16"
        for name, v in (("--weight-bits", wbits), ("--grad-bits", gbits)):
            if v not in (None, "none"):
                raise CLIError(f"{flag} is unquantized FSDP, it cannot be combined with {name} {v}")
        if mode not in (None, "full"):
            raise CLIError(f"{flag} is unquantized FSDP (weight mode full), not --weight-mode {mode}")
        if dtype not in (None, want):
            raise CLIError(f"{flag} communicates in {want}, not --comm-dtype {dtype}")
        wbits = gbits = "none"
        mode, dtype = "full", want
    mode = mode or "qsdp"
    if wbits is None:
        wbits = "none" if mode == "full" else 8
    if gbits is None:
        gbits = 8
    if mode == "full" and wbits != "none":
        raise CLIError(
            f"--weight-mode full gathers full-precision weights and cannot use --weight-bits {wbits}: "
            "use --weight-mode qsdp or comm to quantize weights, or --weight-bits none"
        )
    if mode in ("qsdp", "comm") and wbits == "none":
        raise CLIError(
            f"--weight-mode {mode} quantizes weights and needs --weight-bits 1..8; "
            "for full-precision weights use --weight-mode full (or --fp32 / --bf16)"
        )
    return dict(
        weight_bits=None if wbits == "none" else wbits,
        grad_bits=None if gbits == "none" else gbits,
        bucket_size=args.bucket_size,
        min_shard_size=args.min_shard_size,
        weight_mode=mode,
        weight_rounding=args.weight_rounding,
        fp_comm_dtype=dtype or "float32",
        seed=args.seed,
    )


def default_out(preset: str, name: str) -> Path:
    return RUNS_DIR / f"{preset}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_out_dir(out: Path, overwrite: bool, resume: bool = False) -> None:
    """CLIError if ``out`` is unusable or holds files and ``overwrite`` is not set."""
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite and not resume:
        raise CLIError(
            f"output directory {out} exists and is not empty; pass --overwrite to replace its "
            f"run files ({', '.join(ARTIFACTS)}) or choose another --out"
        )


# ----------------------------------------------------------------------------------------------
# Devices


def select_devices(n: int):
    import jax

    devs = jax.devices()
    if len(devs) < n:
        raise CLIError(
            f"--devices {n}, but jax was already set up with {len(devs)} device(s) in this process "
            f"({devs[0].platform}); the count of simulated devices can only be chosen before jax is "
            f"imported (XLA_FLAGS=--xla_force_host_platform_device_count={n}); use --devices "
            f"{len(devs)} or run in a fresh process"
        )
    return devs[:n]


# ----------------------------------------------------------------------------------------------
# Progress


class Progress:
    """One progress line on stderr: ``\\r``-updated on a TTY, a plain line every ~10% otherwise."""

    def __init__(self, total: int, tokens_per_step: int, stream=None, enabled: bool = True):
        self.total = total
        self.tokens = tokens_per_step
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, total // 10)
        self.times: list[float] = []
        self.last_val: float | None = None
        self._last_draw = 0.0
        self._width = 0

    def update(self, log) -> None:
        self.times.append(log.seconds)
        if log.val_loss is not None:
            self.last_val = log.val_loss
        if not self.enabled:
            return
        done = log.step >= self.total
        if self.tty:
            now = time.monotonic()
            if done or log.val_loss is not None or now - self._last_draw > 0.1:
                self._last_draw = now
                line = self._line(log)
                self.stream.write("\r" + line.ljust(self._width))
                self._width = len(line)
                if done:
                    self.stream.write("\n")
                self.stream.flush()
        elif done or log.step % self.every == 0 or log.step == 1:
            self.stream.write(self._line(log) + "\n")
            self.stream.flush()

    def _line(self, log) -> str:
        timed = self.times[1:] or self.times  # the first step includes compilation
        recent = timed[-50:]
        sec = sum(recent) / len(recent)
        eta = sec * (self.total - log.step)
        w = len(str(self.total))
        val = f"  val {self.last_val:.4f}" if self.last_val is not None else ""
        return (
            f"step {log.step:>{w}}/{self.total}  loss {log.loss:.4f}{val}  "
            f"{self.tokens / sec:,.0f} tok/s  ETA {_hms(eta)}"
        )


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# ----------------------------------------------------------------------------------------------
# Output


def _num(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def plot_loss(history, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([h.step for h in history], [h.loss for h in history], lw=1, label="train loss")
    val = [(h.step, h.val_loss) for h in history if h.val_loss is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    import io

    from experiments.run_files import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def summary_text(summary: dict, report_table: str | None) -> str:
    lines = [
        f"run            {summary['name']}  ({summary['n_params']:,} params, "
        f"{summary['n_devices']} simulated devices, {summary['steps']} steps)",
        f"train loss     {summary['train_loss']:.4f}  (mean of the last 10% of steps)",
        f"val loss       {summary['val_loss']:.4f}",
        f"tokens/s       {summary['tokens_per_s']:,.0f}  (simulated devices on CPU: compute, "
        "not network, speed)",
        f"time           setup {summary['setup_s']:.1f} s (data, init, compiling)   "
        f"wall {summary['wall_s']:.1f} s",
        f"wire bytes     {_num(summary['wire_bytes_per_step'])} per device per step",
    ]
    ratio = summary.get("bytes_ratio_vs_fp32")
    if ratio is not None:
        lines.append(
            f"vs fp32 FSDP   {ratio:.2f}x fewer bytes ({_num(summary['fp32_wire_bytes_per_step'])} "
            "per step in fp32)"
        )
    if summary["nonfinite_steps"]:
        lines.append(f"WARNING        {summary['nonfinite_steps']} step(s) skipped for non-finite gradients")
    if report_table:
        lines += ["", report_table]
    lines.append(f"\nwrote {summary['out_dir']}/{{{','.join(ARTIFACTS)}}}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The run


def build_run_config(args: argparse.Namespace):
    """(QSDPConfig, RunConfig) from the flags; CLIError on any invalid value or combination."""
    import qsdp_jax as q
    from experiments.trainer import RunConfig

    kw = qsdp_kwargs(args)
    overrides = tuple(
        (k, v) for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers), ("n_heads", args.n_heads))
        if v is not None
    )
    warmup = args.warmup  # None: RunConfig picks min(30, steps // 10)
    eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 5)
    try:
        cfg = q.QSDPConfig(**kw)
        run = RunConfig(
            qsdp=cfg, preset=args.preset, model_overrides=overrides, steps=args.steps,
            batch_size=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=warmup,
            schedule=args.schedule, seed=args.seed, eval_every=eval_every,
            eval_batches=args.eval_batches, data_path=None if args.data is None else str(args.data),
        )
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    return cfg, run


def fp32_wire_bytes(trainer) -> float:
    """Wire bytes per step of the fp32 FSDP step for the same model, mesh and batch (compiled
    from abstract state, nothing allocated)."""
    import jax

    import qsdp_jax as q
    from experiments.trainer import make_optimizer
    from qsdp_jax import comm

    run = dataclasses.replace(
        trainer.run, qsdp=q.QSDPConfig.fp32(
            bucket_size=trainer.run.qsdp.bucket_size, min_shard_size=trainer.run.qsdp.min_shard_size,
            seed=trainer.run.qsdp.seed, axis_name=trainer.run.qsdp.axis_name,
        )
    )
    opt = make_optimizer(run)
    params = jax.eval_shape(lambda: trainer.model.init_params(run.seed))
    state = q.abstract_train_state(params, opt, trainer.mesh, run.qsdp, stacked=trainer.model.stacked_groups)
    step = q.make_train_step(trainer.model.loss, opt, trainer.mesh, run.qsdp)
    return comm.comm_report(step, state, trainer.batch(0)).total_bytes


def run_cli(args: argparse.Namespace, *, print_summary: bool = True):
    """Run the training the flags describe; returns the RunResult. CLIError on bad flags or
    environment, before anything is written."""
    if args.data is not None and not Path(args.data).is_file():
        raise CLIError(f"--data {args.data}: no such file")
    if args.batch % args.devices:
        raise CLIError(
            f"--batch {args.batch} does not divide over --devices {args.devices}: use a multiple of "
            f"{args.devices}"
        )
    if args.out is not None:
        check_out_dir(Path(args.out), args.overwrite, args.resume)  # before the (slow) jax import
    simulate_cpu_devices(args.devices)
    devices = select_devices(args.devices)
    cfg, run = build_run_config(args)
    out = Path(args.out) if args.out is not None else default_out(args.preset, cfg.name)
    check_out_dir(out, args.overwrite, args.resume)

    from experiments import trainer as tr

    t_start = time.perf_counter()
    if not args.quiet:
        print(f"{cfg.name}: setting up on {len(devices)} device(s) and compiling the train step ...",
              file=sys.stderr, flush=True)
    try:
        trainer = tr.Trainer(run, devices)
        # Evaluation batches are drawn lazily by the trainer: check the split holds one now.
        from experiments import data as textdata

        seq = trainer.model.cfg.seq_len
        textdata.eval_batches(trainer.dataset.val, run.batch_size, seq, run.eval_batches)
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"cannot set up the run: {e}") from None

    out.mkdir(parents=True, exist_ok=True)
    ckpts = open_checkpoints(args, out)
    start = resume_step(ckpts, trainer, args) if ckpts is not None else 0
    config = run.as_dict()
    config.update(
        name=cfg.name,
        model=dataclasses.asdict(trainer.model.cfg),
        n_params=trainer.model.count_params(),
        n_devices=trainer.n_devices,
        data_source=trainer.dataset.source,
        argv=list(getattr(args, "argv", None) or []),
    )
    from experiments.run_files import write_atomic

    write_atomic(out / "config.json", json.dumps(config, indent=1) + "\n")

    t_compile = time.perf_counter()
    report = trainer.wire_report()  # compiles the step (the first step then reuses it)
    compile_s = time.perf_counter() - t_compile
    fp32_bytes = None
    if not (cfg.weight_bits is None and cfg.grad_bits is None and cfg.fp_comm_dtype == "float32"):
        if not args.no_fp32_ratio:
            fp32_bytes = fp32_wire_bytes(trainer)
    else:
        fp32_bytes = report.total_bytes

    setup_s = time.perf_counter() - t_start
    progress = Progress(run.steps, run.batch_size * trainer.model.cfg.seq_len, enabled=not args.quiet)
    history = train_loop(trainer, out, start, progress, ckpts, args.failure_timeout)

    result = tr.summarise(trainer, history, report, time.perf_counter() - t_start, compile_s)
    summary = {k: v for k, v in result.as_dict().items() if k != "history"}
    summary.update(
        name=cfg.name, steps=run.steps, out_dir=str(out), setup_s=setup_s,
        fp32_wire_bytes_per_step=fp32_bytes,
        bytes_ratio_vs_fp32=(fp32_bytes / report.total_bytes) if fp32_bytes and report.total_bytes else None,
    )
    write_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    model = trainer.model.cfg
    plot_loss(history, out / "loss.png",
              f"{cfg.name}: GPT d{model.d_model} L{model.n_layers} on {trainer.n_devices} simulated devices")
    if print_summary:
        if args.quiet:
            print(f"{cfg.name}: train loss {summary['train_loss']:.4f}, val loss {summary['val_loss']:.4f}, "
                  f"{_num(summary['wire_bytes_per_step'])}/step; wrote {out}")
        else:
            print(summary_text(summary, report.table()))
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
            return int(exit_.code)
    except KeyboardInterrupt:
        return 130
    except Stopped as e:
        print(str(e), file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
