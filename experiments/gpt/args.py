"""Flags of ``python -m experiments.gpt.train``: the parser, the checks of
flag combinations and of the output directory (:class:`CLIError` on anything invalid).

Imports nothing that uses jax (the number of simulated devices is set before jax starts).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.gpt.arg_types import (
    nonnegative_int,
    parse_bit_policy,
    parse_bits,
    parse_seconds,
    parse_seed,
    positive_float,
    positive_int,
)
from experiments.gpt.cluster_args import add_cluster_args, mesh_config_kwargs

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = REPO_ROOT / "runs"
PRESETS = ("tiny", "small", "medium")
ARTIFACTS = ("config.json", "metrics.jsonl", "summary.json", "loss.png")


class CLIError(Exception):
    """A bad flag, flag combination or environment; reported as an argparse error (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.gpt.train",
        usage="%(prog)s [options]   (--help for the list)",
        description="Train the byte-level GPT with QSDP (quantized FSDP) or an FSDP baseline, "
        "through the real sharded train step, on the devices JAX finds (GPU, TPU, else CPU).",
        epilog="Baselines: --fp32 (FSDP, fp32 collectives), --bf16 (FSDP, bf16 collectives). "
        "Default: QSDP W8G8 (weights on a randomly shifted 8-bit grid, 8-bit gradients).",
    )
    _add_model_training_args(p)
    _add_comm_args(p)
    _add_output_checkpoint_args(p)
    add_cluster_args(p)
    return p


def _add_model_training_args(p: argparse.ArgumentParser) -> None:
    """The model-size and training flags."""
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=PRESETS, default="tiny", help="model size (default: tiny)")
    m.add_argument("--d-model", type=positive_int, help="override the preset's width")
    m.add_argument("--n-layers", type=positive_int, help="override the preset's depth")
    m.add_argument("--n-heads", type=positive_int, help="override the preset's number of heads")
    m.add_argument("--seq-len", type=positive_int, help="override the preset's context length")

    t = p.add_argument_group("training")
    t.add_argument("--steps", type=positive_int, default=300, help="training steps (default: 300)")
    t.add_argument(
        "--batch",
        type=positive_int,
        default=16,
        help="global batch size in sequences, a multiple of --devices (default: 16)",
    )
    t.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (default: 3e-3)")
    t.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="learning-rate schedule after warmup (default: cosine)",
    )
    t.add_argument(
        "--mu-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of adam's first moment (default: float32; bfloat16 saves 2 bytes of "
        "optimizer state per parameter, see docs/results/convergence.md for its accuracy)",
    )
    t.add_argument(
        "--moments-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype both of adam's moments are stored in (default: float32; bfloat16, rounded "
        "stochastically by qsdp_jax.optim.compact_moments, saves 4 bytes per parameter)",
    )
    t.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=None,
        help="linear warmup steps (default: 30, or steps // 10 if that is smaller)",
    )
    t.add_argument(
        "--seed",
        type=parse_seed,
        default=0,
        help="seed of the initial weights, data order and quantization noise (default: 0)",
    )
    t.add_argument(
        "--eval-every",
        type=positive_int,
        default=None,
        help="validate every N steps and at the end (default: steps // 5)",
    )
    t.add_argument(
        "--eval-batches", type=positive_int, default=8, help="validation batches per evaluation (default: 8)"
    )
    t.add_argument("--data", default=None, help="a UTF-8 text file to train on (default: Shakespeare)")


def _add_comm_args(p: argparse.ArgumentParser) -> None:
    """The quantization / communication flags and the --fp32 / --bf16 baselines."""
    qz = p.add_argument_group("quantization / communication")
    qz.add_argument(
        "--weight-bits",
        type=parse_bits,
        default=None,
        metavar="{1..8,none}",
        help="bits per weight on the all-gather (default: 8; none with --weight-mode full)",
    )
    qz.add_argument(
        "--grad-bits",
        type=parse_bits,
        default=None,
        metavar="{1..8,none}",
        help="bits per gradient on the reduce-scatter (default: 8)",
    )
    qz.add_argument(
        "--bucket-size",
        type=positive_int,
        default=1024,
        help="elements per quantization bucket, a multiple of 8 (default: 1024)",
    )
    qz.add_argument(
        "--min-shard-size",
        type=nonnegative_int,
        default=4096,
        help="leaves smaller than this stay replicated in full precision (default: 4096)",
    )
    qz.add_argument(
        "--weight-mode",
        choices=("qsdp", "comm", "full"),
        default=None,
        help="qsdp: weights kept on a shifted grid (default); comm: quantized only "
        "for the all-gather (ZeRO++-style); full: full-precision gather",
    )
    qz.add_argument(
        "--weight-rounding",
        choices=("shift", "stochastic"),
        default=None,
        help="how qsdp mode puts updated weights on a grid: stochastic rounding "
        "(the default) or the paper's random shift",
    )
    qz.add_argument(
        "--comm-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="dtype of the unquantized collectives (default: float32)",
    )
    qz.add_argument(
        "--grad-rotation",
        type=positive_int,
        default=None,
        metavar="BLOCK",
        help="rotate gradient chunks blockwise by a randomized Hadamard transform before "
        "quantizing (a power of 2 dividing --bucket-size; default: off)",
    )
    qz.add_argument(
        "--stats-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the per-bucket scale and offset on the wire (default: float32; "
        "bfloat16 halves their bytes; comm and full weight modes only)",
    )
    qz.add_argument(
        "--weight-storage",
        choices=("float32", "codes"),
        default="float32",
        help="how the train state holds the gridded weights: float32 (default) or their packed "
        "codes (a quarter of the bytes at 8 bits, the same training; qsdp weight mode only)",
    )
    qz.add_argument(
        "--bit-policy",
        type=parse_bit_policy,
        default=(),
        metavar="'PAT=W,G;...'",
        help="per-leaf bits by parameter path, first match wins: e.g. "
        "'embed*=8,8' keeps the embeddings at 8-bit weights and gradients (bits 1..8 "
        "or none; patterns are fnmatch on 'group/key/...' paths, see qsdp_jax._src.layout.policy)",
    )
    base = qz.add_mutually_exclusive_group()
    base.add_argument(
        "--fp32", action="store_true", help="the fp32 FSDP baseline (weight/grad bits none, mode full, fp32 comm)"
    )
    base.add_argument(
        "--bf16", action="store_true", help="the bf16 FSDP baseline (weight/grad bits none, mode full, bf16 comm)"
    )


def _add_output_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The devices / output and checkpoint flags."""
    o = p.add_argument_group("environment / output")
    o.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="use the first N devices (default: all; on a machine with only a CPU, N simulated CPU devices, default 8)",
    )
    o.add_argument(
        "--simulate-devices",
        type=positive_int,
        default=None,
        metavar="N",
        help="run on N simulated CPU devices even where a GPU/TPU is present",
    )
    o.add_argument(
        "--out", type=Path, default=None, help="output directory (default: runs/<preset>-<config>-<timestamp>)"
    )
    o.add_argument(
        "--overwrite", action="store_true", help="replace this tool's files in an existing non-empty output directory"
    )
    o.add_argument(
        "--no-fp32-ratio", action="store_true", help="skip compiling the fp32 step for the bytes-vs-fp32 ratio"
    )
    o.add_argument("--quiet", action="store_true", help="no progress line; a one-line summary instead of the full one")

    c = p.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where checkpoints go (default: <out>/checkpoints when --checkpoint-every or --resume is given)",
    )
    c.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        help="save every N steps, asynchronously (and always on SIGTERM/SIGINT and at the end)",
    )
    c.add_argument("--keep", type=positive_int, default=3, help="complete checkpoints kept (default: 3)")
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint (start fresh when there is none); "
        "metrics continue the same metrics.jsonl",
    )
    c.add_argument(
        "--failure-timeout",
        type=parse_seconds,
        default=None,
        metavar="S",
        help="exit (status 75, after trying to save) when no step finishes for S seconds "
        "or a collective fails, e.g. a peer process died (default: off; S > 0; 60 is a good "
        "bound for multi-process runs)",
    )
    c.add_argument(
        "--max-skipped-steps",
        type=nonnegative_int,
        default=10,
        metavar="N",
        help="stop (status 1) after N steps in a row whose gradients were non-finite, every one "
        "skipped: a run that cannot train says so instead of finishing with a NaN loss (default: "
        "10; 0: never stop)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _lever_kwargs(args: argparse.Namespace) -> dict:
    """``grad_rotation`` / ``stats_dtype`` / ``weight_storage`` when their flags are given (absent when off, so the
    kwargs of every other run stay what they were)."""
    out = {}
    if getattr(args, "grad_rotation", None) is not None:
        out["grad_rotation"] = args.grad_rotation
    if getattr(args, "stats_dtype", "float32") != "float32":
        out["stats_dtype"] = args.stats_dtype
    if getattr(args, "weight_storage", "float32") != "float32":
        out["weight_storage"] = args.weight_storage
    return out


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
    try:
        levels = mesh_config_kwargs(args.mesh)
    except ValueError as e:
        raise CLIError(str(e)) from None
    for name in ("inter_weight_bits", "inter_grad_bits"):
        v = getattr(args, name)
        if v is not None:  # "none": full precision on the outer level, written as None
            levels[name] = None if v == "none" else v
            if v == "none" and "node_axis" not in levels and "replica_axis" not in levels:
                raise CLIError(
                    f"--{name.replace('_', '-')} needs a 2-D --mesh (node=...,local=... or replica=...,fsdp=...)"
                )
    return dict(
        **levels,
        weight_bits=None if wbits == "none" else wbits,
        grad_bits=None if gbits == "none" else gbits,
        bucket_size=args.bucket_size,
        min_shard_size=args.min_shard_size,
        weight_mode=mode,
        fp_comm_dtype=dtype or "float32",
        **_lever_kwargs(args),
        seed=args.seed,
        bit_policy=getattr(args, "bit_policy", ()),
        **({} if args.weight_rounding is None else {"weight_rounding": args.weight_rounding}),
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
