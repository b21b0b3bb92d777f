"""Killed, nothing lost: the trainer SIGKILLed at random moments (during steps and during
checkpoint saves), resumed each time, ends with the uninterrupted run's final state bit for bit
and the same metrics, every step once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qsdp_jax.checkpoint import Checkpointer
from tests.trainer_flags import trainer_flags

REPO = Path(__file__).resolve().parent.parent
STEPS = 32  # long enough that no life finishes the run before its kill lands (5 lives: 14 steps, seen)
KILLS = 4
ARGS = trainer_flags(
    min_shard_size=256,
    lr="1e-2",
    warmup=1,
    no_fp32_ratio=True,
    quiet=True,
    steps=STEPS,
    eval_every=16,
    devices=2,
    checkpoint_every=1,
    keep=2,
)


def _cache_env(cache: Path) -> dict:
    """JAX's persistent compilation cache: every life after the first skips compiling (12.7 ->
    4.6 s of CPU per life measured), the executables, and so the numbers, are the same."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _start(out: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "experiments.gpt.train", *ARGS, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), **_cache_env(out.parent / "jax-cache")}
    return subprocess.Popen(
        cmd + (["--resume"] if resume else []),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _rows(out: Path) -> int:
    try:
        return (out / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def _final(out: Path):
    with Checkpointer(out / "checkpoints") as c:
        assert c.latest_step() == STEPS
        arrays = c.load_arrays()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return arrays, rows


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path):
    ref = tmp_path / "ref"
    p = _start(ref, resume=False)
    assert p.wait(timeout=600) == 0, p.stderr.read()
    rng = np.random.default_rng(1234)  # seeded kill times
    out = tmp_path / "killed"
    kills_mid_save = kills_done = 0
    for _ in range(KILLS):
        before = _rows(out)
        p = _start(out, resume=True)
        deadline = time.monotonic() + 300
        while _rows(out) <= before and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for this life's first new step, then kill soon after
        time.sleep(float(rng.uniform(0.0, 0.2)))
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            kills_done += 1
        p.wait(timeout=60)
        p.stderr.close()
        ckpts = out / "checkpoints"
        kills_mid_save += any("tmp" in q.name for q in ckpts.iterdir()) if ckpts.exists() else 0
    p = _start(out, resume=True)
    assert p.wait(timeout=600) == 0, p.stderr.read()
    assert kills_done >= KILLS - 2  # (a life may finish the run before its kill lands)
    assert kills_mid_save >= 1  # at least one kill left a half-written checkpoint behind
    (want, want_rows), (got, got_rows) = _final(ref), _final(out)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert [r["step"] for r in got_rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got_rows] == [r["loss"] for r in want_rows]
