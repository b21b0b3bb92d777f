"""What the convergence experiment runs, and what it has done: configurations, run keys, the
per-run records on disk and the plan of what is left. No jax here (``--plan`` is instant).

A run is one ``(corpus, configuration, seed)``. A seed sets everything random in a run: the
initial weights and the data order (``RunConfig.seed``) and the quantization noise
(``QSDPConfig.seed``), so the fp32 run of seed ``s`` and a quantized run of seed ``s`` start from
the same weights and see the same batches: their gap is paired.

Each finished run is one small JSON record at ``<root>/<corpus>/<config>/seed<s>.json`` (root:
``experiments/results/convergence_runs``, committed: see .gitignore), written atomically. The
record keeps the run's settings (model, steps, batch, lr, ...), the git commit it was made on, the
final losses, the validation points (not the per-step history) and the wire bytes of the compiled
step. A record whose settings differ from the ones asked for is never mixed in: :func:`plan`
reports it as a conflict and the experiment refuses to run until it is moved away.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

from experiments.gpt.files import write_atomic  # temp file + fsync + rename

__all__ = [
    "CONFIGS",
    "DEFAULT_SEEDS",
    "GROUPS",
    "LEVERS",
    "REFERENCE",
    "ConfigSpec",
    "Plan",
    "RunKey",
    "Settings",
    "compact_record",
    "git_commit",
    "load_records",
    "plan",
    "run_keys",
    "select_configs",
    "write_record",
]

REFERENCE = "fp32"
"""The configuration every gap is measured against (paired by seed)."""

DEFAULT_SEEDS = (0, 1, 2)
GROUPS = ("reference", "main", "diagnostic", "frontier")
DROPPED = "dropped"  # configurations QSDPConfig refuses now, kept for their records


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """One configuration: ``QSDPConfig`` keyword arguments (without the seed) and its group."""

    name: str
    qsdp: dict
    group: str
    note: str = ""
    run: tuple = ()  # RunConfig fields other than the experiment's Settings, e.g. (("mu_dtype", "bfloat16"),)


def _spec(name: str, group: str, note: str = "", run: Any = (), **qsdp) -> ConfigSpec:
    # (run: Any, since the QSDPConfig kwargs splatted in as **dict[str, ...] could name it)
    return ConfigSpec(name=name, qsdp=qsdp, group=group, note=note, run=run)


_FP = dict(weight_bits=None, grad_bits=None, weight_mode="full")
_SR = dict(weight_rounding="stochastic")

CONFIGS: dict[str, ConfigSpec] = {
    s.name: s
    for s in [
        _spec("fp32", "reference", "FSDP, fp32 collectives: the paired baseline", **_FP),
        _spec("bf16", "main", "FSDP, bf16 collectives", **_FP, fp_comm_dtype="bfloat16"),
        _spec(
            "qsdp-W8G8",
            "main",
            "weights on the grid, the paper's random shift",
            weight_bits=8,
            grad_bits=8,
            weight_rounding="shift",
        ),
        _spec("qsdp-W6G6", "main", "the paper's shift", weight_bits=6, grad_bits=6, weight_rounding="shift"),
        _spec("qsdp-W4G4", "main", "the paper's shift", weight_bits=4, grad_bits=4, weight_rounding="shift"),
        _spec("qsdp-sr-W8G8", "main", "weights on the grid, stochastic rounding", weight_bits=8, grad_bits=8, **_SR),
        _spec("qsdp-sr-W6G6", "main", "stochastic rounding", weight_bits=6, grad_bits=6, **_SR),
        _spec("qsdp-sr-W4G4", "main", "stochastic rounding", weight_bits=4, grad_bits=4, **_SR),
        _spec(
            "comm-W8G8",
            "main",
            "ZeRO++-style: fp32 master, quantized gather",
            weight_mode="comm",
            weight_bits=8,
            grad_bits=8,
        ),
        _spec("comm-W4G4", "main", "ZeRO++-style", weight_mode="comm", weight_bits=4, grad_bits=4),
        # diagnostics: separate the two quantizers, bucket size
        _spec(
            "qsdp-W8GF32",
            "diagnostic",
            "8-bit weights (shift), fp32 gradients",
            weight_bits=8,
            grad_bits=None,
            weight_rounding="shift",
        ),
        _spec(
            "qsdp-sr-W8G8-b256", "diagnostic", "256-element buckets", weight_bits=8, grad_bits=8, bucket_size=256, **_SR
        ),
        _spec(
            "qsdp-sr-W4GF32",
            "diagnostic",
            "4-bit weights on the grid, fp32 gradients: the weights' share",
            weight_bits=4,
            grad_bits=None,
            **_SR,
        ),
        _spec(
            "full-WF32G4",
            "diagnostic",
            "fp32 weights and gather, 4-bit gradients: the gradients' share",
            **_FP | dict(grad_bits=4),
        ),
        _spec(
            "full-WF32G2-rot64",
            "diagnostic",
            "fp32 weights, 2-bit rotated gradients: what 2-bit gradients cost",
            **_FP | dict(grad_bits=2, grad_rotation=64),
        ),
        # frontier slots, with today's switches; the levers of issue 13 (compact statistics,
        # Hadamard, error feedback, bit policies) add their configurations here
        _spec(
            "qsdp-sr-W4G4-b256",
            "frontier",
            "4 bits, smaller buckets",
            weight_bits=4,
            grad_bits=4,
            bucket_size=256,
            **_SR,
        ),
        _spec(
            "qsdp-sr-W4G4-b128",
            "frontier",
            "4 bits, 128-element buckets (float32 stats: +0.5 bits)",
            weight_bits=4,
            grad_bits=4,
            bucket_size=128,
            **_SR,
        ),
        _spec("qsdp-sr-W4G3", "frontier", "", weight_bits=4, grad_bits=3, **_SR),
        _spec("qsdp-sr-W3G3", "frontier", "", weight_bits=3, grad_bits=3, **_SR),
        _spec("comm-W4G2", "frontier", "", weight_mode="comm", weight_bits=4, grad_bits=2),
        _spec("comm-W3G3", "frontier", "", weight_mode="comm", weight_bits=3, grad_bits=3),
        # grad_rotation (blockwise randomized Hadamard before the gradient quantizer) and
        # stats_dtype="bfloat16" (4 bytes of stats per bucket instead of 8)
        _spec(
            "qsdp-sr-W4G4-rot64",
            "frontier",
            "Hadamard rotation of gradient chunks, blocks of 64",
            weight_bits=4,
            grad_bits=4,
            grad_rotation=64,
            **_SR,
        ),
        _spec("qsdp-sr-W4G3-rot64", "frontier", "", weight_bits=4, grad_bits=3, grad_rotation=64, **_SR),
        _spec("qsdp-sr-W3G3-rot64", "frontier", "", weight_bits=3, grad_bits=3, grad_rotation=64, **_SR),
        _spec(
            "comm-W3G2-rot64-b256-bf16stats",
            "frontier",
            "comm-W3G2-rot64 with 256-element buckets, bf16 stats",
            weight_mode="comm",
            weight_bits=3,
            grad_bits=2,
            grad_rotation=64,
            bucket_size=256,
            stats_dtype="bfloat16",
        ),
        _spec(
            "comm-W4G2-rot64",
            "frontier",
            "2-bit gradients with the rotation",
            weight_mode="comm",
            weight_bits=4,
            grad_bits=2,
            grad_rotation=64,
        ),
        _spec(
            "qsdp-sr-W3G2-rot64",
            "frontier",
            "under 3 wire bits: 2-bit rotated gradients",
            weight_bits=3,
            grad_bits=2,
            grad_rotation=64,
            **_SR,
        ),
        _spec(
            "comm-W3G2-rot64",
            "frontier",
            "under 3 wire bits with an fp32 master copy",
            weight_mode="comm",
            weight_bits=3,
            grad_bits=2,
            grad_rotation=64,
        ),
        _spec(
            "comm-W2G2-rot64",
            "frontier",
            "where the fp32 master copy stops helping?",
            weight_mode="comm",
            weight_bits=2,
            grad_bits=2,
            grad_rotation=64,
        ),
        # bit policy: the embeddings (tied: also the output head) at W8G8, the rest lower
        _spec(
            "qsdp-sr-W4G4-emb8",
            "frontier",
            "embeddings (tied output head) at W8G8, the rest W4G4",
            weight_bits=4,
            grad_bits=4,
            bit_policy=(("embed/*", 8, 8),),
            **_SR,
        ),
        _spec(
            "qsdp-sr-W3G3-emb8",
            "frontier",
            "embeddings (tied output head) at W8G8, the rest W3G3",
            weight_bits=3,
            grad_bits=3,
            bit_policy=(("embed/*", 8, 8),),
            **_SR,
        ),
        # compact optimizer state: adam's first moment in bfloat16 (2 bytes less per parameter)
        _spec(
            "qsdp-sr-W8G8-mu-bf16",
            "diagnostic",
            "qsdp-sr-W8G8 with adam's first moment in bfloat16",
            run=(("mu_dtype", "bfloat16"),),
            weight_bits=8,
            grad_bits=8,
            **_SR,
        ),
        # both moments in bfloat16, rounded stochastically (4 bytes less per parameter)
        _spec(
            "qsdp-sr-W8G8-moments-bf16",
            "diagnostic",
            "qsdp-sr-W8G8 with both of adam's moments in bfloat16, rounded stochastically",
            run=(("moments_dtype", "bfloat16"),),
            weight_bits=8,
            grad_bits=8,
            **_SR,
        ),
        # dropped: QSDPConfig now refuses these; their records stay in the report
        _spec(
            "qsdp-sr-W4G4-b256-bf16stats",
            DROPPED,
            "QSDPConfig refuses it: bf16 stats ratchet the on-grid range (experiments/convergence/grid_walk.py)",
            weight_bits=4,
            grad_bits=4,
            bucket_size=256,
            stats_dtype="bfloat16",
            **_SR,
        ),
        _spec(
            "qsdp-sr-W4G4-golden",
            DROPPED,
            "golden rounding (uniform per weight frac(u0 + 0.618 t)): "
            "built in 8516378, no measurable gain over stochastic on the GPT, removed",
            weight_bits=4,
            grad_bits=4,
            weight_rounding="golden",
        ),
    ]
}

LEVERS: tuple[tuple[str, str, str], ...] = (
    ("qsdp-sr-W4G4-golden", "qsdp-sr-W4G4", "golden rounding"),
    ("qsdp-sr-W4G4-b256", "qsdp-sr-W4G4", "256-element buckets"),
    ("qsdp-sr-W4G4-b128", "qsdp-sr-W4G4", "128-element buckets"),
    ("qsdp-sr-W4G4-rot64", "qsdp-sr-W4G4", "Hadamard rotation of the gradients"),
    ("qsdp-sr-W4G4-emb8", "qsdp-sr-W4G4", "embeddings at 8 bits"),
    ("comm-W4G4", "qsdp-sr-W4G4", "an fp32 master copy (weights quantized for the gather only)"),
    ("qsdp-sr-W8G8", "qsdp-W8G8", "stochastic rounding instead of the paper's shift, 8 bits"),
    ("qsdp-sr-W8G8-mu-bf16", "qsdp-sr-W8G8", "adam's first moment in bfloat16"),
    ("qsdp-sr-W8G8-moments-bf16", "qsdp-sr-W8G8", "both of adam's moments in bfloat16, rounded stochastically"),
)
"""``(configuration, base, what it changes)``: the report gives, per corpus, the paired difference
of the two configurations' gaps over the seeds both have (experiments.convergence.levers)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one experiment shares; records with other settings are not mixed in."""

    preset: str = "small"
    steps: int = 1000
    batch: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 50
    eval_every: int = 100
    eval_batches: int = 32
    devices: int = 8

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, order=True)
class RunKey:
    corpus: str
    config: str
    seed: int

    def path(self, root: Path) -> Path:
        return Path(root) / self.corpus / self.config / f"seed{self.seed}.json"

    def __str__(self) -> str:
        return f"{self.corpus}/{self.config}/seed{self.seed}"


def select_configs(only: list[str] | None = None, groups: list[str] | None = None) -> list[str]:
    """Configuration names by ``--only`` names and/or ``--group`` groups (default: reference and
    main), always with the reference first; ``ValueError`` naming what is unknown."""
    unknown = sorted(set(only or ()) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    bad = sorted(set(groups or ()) - set(GROUPS))
    if bad:
        raise ValueError(f"unknown group(s) {bad}; groups are {list(GROUPS)}")
    dropped = sorted(n for n in only or () if CONFIGS[n].group == DROPPED)
    if dropped:
        raise ValueError(
            f"configuration(s) {dropped} are dropped and cannot be trained again: "
            + "; ".join(CONFIGS[n].note for n in dropped)
        )
    if not only and not groups:
        groups = ["reference", "main"]
    chosen = {n for n in only or ()} | {n for n, s in CONFIGS.items() if s.group in (groups or ())}
    return [REFERENCE] + [n for n in CONFIGS if n in chosen and n != REFERENCE]


def run_keys(corpora, configs, seeds) -> list[RunKey]:
    """Runs in training order: corpus by corpus, seed by seed, the reference first in each seed,
    so every finished seed is a complete paired comparison."""
    return [RunKey(c, n, int(s)) for c in corpora for s in seeds for n in configs]


# ----------------------------------------------------------------------------------------------
# Records


def git_commit(repo: Path | None = None) -> str | None:
    """``HEAD`` of the repository, ``+dirty`` if tracked code (``qsdp_jax/``, ``experiments/``
    outside ``results/``) differs from it; None outside git."""
    cwd = repo or Path(__file__).resolve().parent
    code = ["qsdp_jax", "experiments", ":(exclude)experiments/results"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *code],
            cwd=top,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def compact_record(result: dict, key: RunKey, settings: Settings, commit: str | None) -> dict:
    """The committed record of one run: ``RunResult.as_dict()`` without the per-step history,
    with the validation points ``[step, train loss, val loss]`` and the run's identity; the text
    file is named by its cache file name (which holds the package and parser versions)."""
    rec = {k: v for k, v in result.items() if k != "history"}
    if rec.get("config", {}).get("data_path"):  # the cache file's name, not this machine's path
        rec["config"] = dict(rec["config"], data_path=Path(rec["config"]["data_path"]).name)
    rec["val_curve"] = [[h["step"], h["loss"], h["val_loss"]] for h in result["history"] if h["val_loss"] is not None]
    rec.update(corpus=key.corpus, config_name=key.config, seed=key.seed, settings=settings.as_dict(), git_commit=commit)
    return rec


def write_record(root: Path, key: RunKey, record: dict) -> Path:
    """Write ``record`` at ``key.path(root)`` atomically (temp file in the same folder, fsync,
    rename): an interrupted run leaves no record, so it is simply run again."""
    path = key.path(root)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return path


def load_records(root: Path) -> dict[RunKey, dict]:
    """Every record under ``root``, by key (``ValueError`` naming a file that is not one)."""
    out = {}
    for p in sorted(Path(root).glob("*/*/seed*.json")):
        try:
            rec = json.loads(p.read_text())
            key = RunKey(rec["corpus"], rec["config_name"], int(rec["seed"]))
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{p} is not a convergence run record ({e})") from None
        if key.path(root) != p:
            raise ValueError(f"{p} holds the record of {key}, which belongs at {key.path(root)}")
        out[key] = rec
    return out


# ----------------------------------------------------------------------------------------------
# The plan

SECONDS_PER_STEP = {"tiny": 0.03, "small": 0.15, "medium": 1.2}
"""Rough 2-core CPU step times for a first estimate (small: ~150 s per 1000 steps, measured);
records of the same settings replace them."""
SETUP_S = 15.0


@dataclasses.dataclass
class Plan:
    done: list[RunKey]
    todo: list[RunKey]
    conflicts: list[tuple[RunKey, str]]  # records made with other settings
    seconds_per_run: float
    commits: dict[str, int] = dataclasses.field(default_factory=dict)  # of the done records

    @property
    def estimate_s(self) -> float:
        return self.seconds_per_run * len(self.todo)

    def chunk(self, max_runs: int | None = None, max_minutes: float | None = None) -> list[RunKey]:
        """The next runs to train: at most ``max_runs``, and as many as the estimate fits in
        ``max_minutes``."""
        n = len(self.todo) if max_runs is None else min(max_runs, len(self.todo))
        if max_minutes is not None:
            n = min(n, int(60 * max_minutes // self.seconds_per_run))
        return self.todo[:n]

    def text(self, root: Path, max_runs: int | None = None, max_minutes: float | None = None) -> str:
        n = len(self.done) + len(self.todo) + len(self.conflicts)
        lines = [
            f"{len(self.done)}/{n} runs done under {root}; {len(self.todo)} left, about "
            f"{_hms(self.estimate_s)} at {self.seconds_per_run:.0f} s per run"
        ]
        if self.commits:
            lines.append(
                "done runs were made on: " + ", ".join(f"{c} ({k} runs)" for c, k in sorted(self.commits.items()))
            )
        by_group: dict[tuple[str, str], list[int]] = {}
        for k in self.todo:
            by_group.setdefault((k.corpus, k.config), []).append(k.seed)
        for (corpus, config), seeds in by_group.items():
            lines.append(f"  todo {corpus:<12} {config:<20} seeds {seeds}")
        for k, why in self.conflicts:
            lines.append(f"  CONFLICT {k}: {why}")
        if (max_runs is not None or max_minutes is not None) and self.todo:
            chunk = self.chunk(max_runs, max_minutes)
            flags = " ".join(
                f
                for f in (max_runs and f"--max-runs {max_runs}", max_minutes and f"--max-minutes {max_minutes:g}")
                if f
            )
            names = [str(k) for k in chunk]
            listed = ", ".join(names) if len(names) <= 8 else f"{names[0]} ... {names[-1]}"
            lines.append(
                f"next chunk ({flags}): {len(chunk)} runs, about {_hms(self.seconds_per_run * len(chunk))}: {listed}"
            )
        return "\n".join(lines)


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def plan(keys: list[RunKey], records: dict[RunKey, dict], settings: Settings) -> Plan:
    """Which of ``keys`` are done (a record with these settings), left, or in conflict."""
    done, todo, conflicts = [], [], []
    want = settings.as_dict()
    for k in keys:
        rec = records.get(k)
        if rec is None:
            todo.append(k)
        elif rec.get("settings") != want:
            diff = {
                f: (rec.get("settings", {}).get(f), v) for f, v in want.items() if rec.get("settings", {}).get(f) != v
            }
            conflicts.append(
                (
                    k,
                    "made with other settings (record, asked): "
                    + ", ".join(f"{f} {a!r} vs {b!r}" for f, (a, b) in diff.items()),
                )
            )
        else:
            done.append(k)
    walls = sorted(r["wall_s"] for k, r in records.items() if r.get("settings") == want)
    if walls:
        per_run = walls[len(walls) // 2]
    else:
        per_run = SETUP_S + settings.steps * SECONDS_PER_STEP.get(settings.preset, 0.15)
    commits: dict[str, int] = {}
    for k in done:
        c = str(records[k].get("git_commit"))
        commits[c] = commits.get(c, 0) + 1
    return Plan(done=done, todo=todo, conflicts=conflicts, seconds_per_run=per_run, commits=commits)
