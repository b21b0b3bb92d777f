"""experiments.bench.speedup_model: the arithmetic on hand-computed cases (no compilation)."""

import json

import pytest

from experiments.bench import speedup_model as sm


def test_comm_and_compute_by_hand():
    assert sm.comm_time(1e9, 100e9) == pytest.approx(0.08)  # 8e9 bits / 1e11 bit/s
    assert sm.comm_time(125e6, 10e9) == pytest.approx(0.1)
    assert sm.compute_time(1e12, 1e13) == pytest.approx(0.1)
    assert sm.comm_time(0, 1e9) == 0.0


def test_predict_step_time_overlap_vs_not():
    # compute 0.1 s, comm 0.08 s
    t = sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=False)
    assert t == pytest.approx(0.18)
    assert sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=True) == pytest.approx(0.1)
    assert sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=0.25) == pytest.approx(0.12)
    # communication-bound: 1e10 bytes at 100 Gbit/s = 0.8 s, compute 0.1 s: overlap hides compute
    assert sm.predict_step_time(1e10, 1e12, 1e13, 100e9, overlap=True) == pytest.approx(0.8)
    assert sm.predict_step_time(1e10, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=0.5) == pytest.approx(0.8)
    assert sm.predict_step_time(1e10, 1e12, 1e13, 100e9, overlap=False) == pytest.approx(0.9)
    # compute-bound with half exposed: max(0.1, 0.5 * 0.08) + 0.04
    assert sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=0.5) == pytest.approx(0.14)
    # overlap is never slower than no overlap, and never faster than the larger part
    for b in (1e8, 1e9, 5e9, 1e10):
        for e in (0.0, 0.1, 0.5, 1.0):
            no = sm.predict_step_time(b, 1e12, 1e13, 100e9, overlap=False)
            yes = sm.predict_step_time(b, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=e)
            assert max(0.1, b * 8 / 100e9) - 1e-12 <= yes <= no + 1e-12
    assert sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=1.0) == pytest.approx(0.18)


def test_ring_scaling():
    assert sm.ring_factor(1) == 0.0
    assert sm.ring_factor(8) == pytest.approx(7 / 8)
    assert sm.collective_volume(7e9, 8) == pytest.approx(8e9)
    # measured 7 GB per device on 8 devices -> 8 GB volume -> on 16 GPUs 8 * 15/16 = 7.5 GB
    assert sm.scale_bytes(7e9, 8, 16) == pytest.approx(7.5e9)
    assert sm.scale_bytes(7e9, 8, 8) == pytest.approx(7e9)
    # bytes leaving a node: ring over all N = M*8 GPUs vs hierarchical over M nodes
    assert sm.link_bytes_per_step(8e9, 2, 8, "ring") == pytest.approx(8e9 * 15 / 16)
    assert sm.link_bytes_per_step(8e9, 2, 8, "hierarchical") == pytest.approx(4e9)
    assert sm.link_bytes_per_step(8e9, 64, 8, "ring") == pytest.approx(8e9 * 511 / 512)
    assert sm.link_bytes_per_step(8e9, 1, 8) == 0.0
    with pytest.raises(ValueError):
        sm.collective_volume(1e9, 1)


def test_predict_grid_by_hand():
    # 8 GB volume (7 GB on 8 devices) for fp32, 2 GB for W8G8; 1e9 FLOP/token; 2 layers.
    measured = {
        "m": {
            "n_devices": 8,
            "n_layers": 2,
            "flops_per_token": 1e9,
            "bytes_per_device": {"fp32": 7e9, "qsdp-W8G8": 1.75e9},
        }
    }
    rows = sm.predict_grid(
        measured,
        schemes=("fp32", "qsdp-W8G8"),
        bandwidths_gbit=(100,),
        nodes=(2,),
        gpus_per_node=8,
        rate=1e13,
        global_batch_tokens=16e3,
    )
    by = {r["scheme"]: r for r in rows}
    fp, q = by["fp32"], by["qsdp-W8G8"]
    # 16k tokens / 16 GPUs = 1000 tokens -> 1e12 FLOPs -> 0.1 s
    assert fp["tokens_per_gpu"] == pytest.approx(1000) and fp["t_compute_s"] == pytest.approx(0.1)
    # fp32: 8e9 * 15/16 = 7.5e9 bytes -> 0.6 s; W8G8: 1.875e9 -> 0.15 s
    assert fp["t_comm_s"] == pytest.approx(0.6) and q["t_comm_s"] == pytest.approx(0.15)
    assert fp["t_step_s"] == pytest.approx(0.7) and q["t_step_s"] == pytest.approx(0.25)
    # overlap, e = 1/2: fp32 max(0.1, 0.3) + 0.3 = 0.6; W8G8 max(0.1, 0.075) + 0.075 = 0.175
    assert fp["t_step_overlap_s"] == pytest.approx(0.6)
    assert q["t_step_overlap_s"] == pytest.approx(0.175)
    assert q["speedup_vs_fp32"] == pytest.approx(0.7 / 0.25)
    assert q["speedup_vs_fp32_overlap"] == pytest.approx(0.6 / 0.175)
    assert fp["speedup_vs_fp32"] == 1.0 and q["speedup_vs_bf16"] is None


@pytest.mark.parametrize(
    "call",
    [
        lambda: sm.comm_time(1e9, -1e9),
        lambda: sm.comm_time(1e9, 0),
        lambda: sm.comm_time(-1, 1e9),
        lambda: sm.compute_time(1e12, 0),
        lambda: sm.compute_time(float("nan"), 1e12),
        lambda: sm.predict_step_time(1e9, 1e12, 1e13, -100e9, overlap=False),
        lambda: sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap=True, exposed_fraction=1.5),
        lambda: sm.predict_step_time(1e9, 1e12, 1e13, 100e9, overlap="yes"),
        lambda: sm.ring_factor(0),
        lambda: sm.link_bytes_per_step(1e9, 0, 8),
        lambda: sm.link_bytes_per_step(1e9, 2, 8, "tree"),
        lambda: sm.tokens_per_gpu(-5, 8),
    ],
)
def test_argument_validation(call):
    with pytest.raises(ValueError):
        call()


def test_check_skips_without_file(tmp_path):
    out = sm.check_against_network(tmp_path / "network.json")
    assert out["skipped"] is True and "does not exist" in out["reason"]
    assert "skipped" in sm.check_table(out)


def test_check_against_fake_network(tmp_path):
    runs = [
        # unshaped: compute-only times
        {"config": "fp32", "bandwidth_mbit": None, "step_time_s": 0.5, "bytes_per_step": 2.5e6, "n_processes": 2},
        {
            "config": "qsdp-W8G8",
            "bandwidth_mbit": None,
            "step_time_s": 0.6,
            "bytes_per_step": 0.625e6,
            "n_processes": 2,
            "extra": "ignored",
        },
        # fp32 at 100 Mbit/s: 2 * 2.5e6 B * 8 / 1e8 = 0.4 s of comm -> predicted 0.9 s
        {"config": "fp32", "bandwidth_mbit": 100, "step_time_s": 1.0, "bytes_per_step": 2.5e6, "n_processes": 2},
        # W8G8 at 100 Mbit/s: 2 * 0.625e6 * 8 / 1e8 = 0.1 s -> predicted 0.7 s (two repeats, median 0.7)
        {
            "config": "qsdp-W8G8",
            "bandwidth_mbit": 100,
            "step_time_s": 0.65,
            "bytes_per_step": 0.625e6,
            "n_processes": 2,
        },
        {
            "config": "qsdp-W8G8",
            "bandwidth_mbit": 100,
            "step_time_s": 0.75,
            "bytes_per_step": 0.625e6,
            "n_processes": 2,
        },
        # no unshaped bf16 run: reported as unmatched
        {"config": "bf16", "bandwidth_mbit": 100, "step_time_s": 0.7, "bytes_per_step": 1.25e6, "n_processes": 2},
    ]
    path = tmp_path / "network.json"
    path.write_text(json.dumps({"runs": runs, "meta": {"host": "x"}}))
    out = sm.check_against_network(path)
    assert out["skipped"] is False
    pairs = {(p["config"], p["bandwidth_mbit"]): p for p in out["pairs"]}
    assert set(pairs) == {("fp32", 100.0), ("qsdp-W8G8", 100.0)}
    fp, q = pairs[("fp32", 100.0)], pairs[("qsdp-W8G8", 100.0)]
    assert fp["predicted_s"] == pytest.approx(0.9) and fp["rel_error"] == pytest.approx(-0.1)
    assert q["measured_s"] == pytest.approx(0.7) and q["predicted_s"] == pytest.approx(0.7)
    assert q["rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert out["mean_abs_rel_error"] == pytest.approx(0.05)
    assert out["unmatched"][0]["config"] == "bf16"
    # each process on its own link: half the bytes through the shaper
    own = sm.check_against_network(path, shared_queue=False)
    assert {p["config"]: p["predicted_s"] for p in own["pairs"]}["fp32"] == pytest.approx(0.7)
    assert "mean absolute relative error" in sm.check_table(out)


def test_check_rejects_bad_schema(tmp_path):
    path = tmp_path / "network.json"
    path.write_text(json.dumps({"runs": [{"bandwidth_mbit": 10}]}))
    with pytest.raises(ValueError):
        sm.check_against_network(path)


def test_table_and_plot(tmp_path):
    measured = {
        "gpt-1.3b": {
            "n_params": 1.3e9,
            "n_devices": 8,
            "n_layers": 24,
            "flops_per_token": 8e9,
            "bytes_per_device": {"fp32": 14e9, "qsdp-W8G8": 3.5e9, "qsdp-W4G4": 1.75e9},
        }
    }
    rows = sm.predict_grid(
        measured, schemes=("fp32", "qsdp-W8G8", "qsdp-W4G4"), bandwidths_gbit=(10, 100), nodes=(2, 4)
    )
    assert len(rows) == 2 * 2 * 3
    text = sm.table(rows, measured, ("fp32", "qsdp-W8G8", "qsdp-W4G4"))
    assert "gpt-1.3b" in text and "W4G4" in text
    sm.plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
