"""experiments.bench.speedup_model: the compiled-program model scaled to more nodes, on hand-made
collective classes and on the committed aot rows (no compilation)."""

import json
from pathlib import Path

import pytest

from experiments.bench import aot
from experiments.bench import speedup_model as sm
from experiments.shelf import targets

AOT_JSON = Path(__file__).resolve().parents[1] / "experiments" / "results" / "aot.json"


def _row(scheme, classes, model="gpt-125m"):
    head = {"target": "h100-16", "model": model, "scheme": scheme, "n_chips": 16, "tokens": 16 * 1024}
    return head | {"collective_classes": classes}


def _cls(group, spans, hidden, nbytes, kind="all-gather"):
    return {"kind": kind, "group": group, "spans_nodes": spans, "hidden": hidden, "bytes": nbytes}


ROWS = [
    _row("gspmd", [_cls(16, True, False, 4e9)]),
    _row("fp32", [_cls(16, True, True, 2e9), _cls(16, True, False, 2e9)]),
    _row("qsdp-W8G8", [_cls(16, True, True, 0.5e9), _cls(16, True, False, 0.5e9)]),
    _row("qsdp-W8G8+2level", [_cls(8, False, False, 0.9e9), _cls(2, True, False, 0.1e9)]),
]


def test_two_nodes_at_the_compiled_batch_is_the_aot_model():
    """Where the two overlap (2 x 8 chips, the compiled batch), the prediction is aot.node_model."""
    target = targets.TARGETS["h100-16"]
    preds = sm.predict(ROWS, bandwidths_gbit=(100,), nodes=(2,))
    for r, p in zip(ROWS, preds):
        want = aot.node_model(target, aot.model_flops("gpt-125m", 16 * 1024), r["collective_classes"], 100)
        assert p["step_s"] == want["step_s"] and p["tokens_per_chip"] == 1024
    by = {p["scheme"]: p for p in preds}
    # gspmd: 4 GB exposed at 12.5 GB/s; W8G8: 0.5 GB exposed, 0.5 GB hidden behind compute
    assert by["gspmd"]["exposed_comm_s"] == pytest.approx(0.32)
    assert by["qsdp-W8G8"]["speedup_vs_gspmd"] == pytest.approx(by["gspmd"]["step_s"] / by["qsdp-W8G8"]["step_s"])
    assert by["qsdp-W8G8"]["speedup_vs_fp32_no_overlap"] == pytest.approx(
        by["fp32"]["step_no_overlap_s"] / by["qsdp-W8G8"]["step_no_overlap_s"]
    )


def test_more_nodes_scale_each_group_and_the_batch():
    preds = sm.predict(ROWS, bandwidths_gbit=(100,), nodes=(8,))
    by = {p["scheme"]: p for p in preds}
    assert by["gspmd"]["inter_bytes"] == pytest.approx(4e9 * (63 / 64) / (15 / 16))
    two = by["qsdp-W8G8+2level"]  # the node axis 2 -> 8, the local axis stays 8 inside a node
    assert two["inter_bytes"] == pytest.approx(0.1e9 * (7 / 8) / (1 / 2)) and two["intra_bytes"] == 0.9e9
    weak = by["gspmd"]["compute_s"]
    strong = {p["scheme"]: p for p in sm.predict(ROWS, bandwidths_gbit=(100,), nodes=(8,), global_batch_tokens=2**19)}
    assert strong["gspmd"]["tokens_per_chip"] == 2**19 / 64
    assert strong["gspmd"]["compute_s"] == pytest.approx(weak * 2**19 / 64 / 1024, rel=1e-12)
    fixed = sm.predict(ROWS[:1], bandwidths_gbit=(100,), nodes=(8,), tokens_per_chip=2048)[0]
    assert fixed["compute_s"] == pytest.approx(2 * weak, rel=1e-12)


def test_the_committed_h100_rows_predict_their_own_two_node_model():
    """The committed aot rows of 2 x 8 H100 and this model agree at 2 nodes, every bandwidth."""
    rows = sm.target_rows(json.loads(AOT_JSON.read_text()), "h100-16")
    assert {"gspmd", "fp32", "qsdp-W8G8"} <= {r["scheme"] for r in rows}
    for r in rows:
        got = sm.predict([r], bandwidths_gbit=[m["inter_gbps"] for m in r["model_time_nodes"]], nodes=(2,))
        assert [p["step_s"] for p in got] == pytest.approx([m["step_s"] for m in r["model_time_nodes"]], rel=1e-12)


@pytest.mark.parametrize(
    "doc, target, match",
    [
        ({"rows": []}, "h100-99", "not known"),
        ({"rows": []}, "h100-8", "one node"),
        ({"rows": []}, "h100-16", "no rows for 'h100-16'"),
        ({"rows": [{"target": "h100-16", "model": "m", "scheme": "s"}]}, "h100-16", "without collective_classes"),
    ],
)
def test_rows_that_cannot_be_scaled_are_refused(doc, target, match):
    with pytest.raises(ValueError, match=match):
        sm.target_rows(doc, target)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tokens_per_chip": 1, "global_batch_tokens": 2}, "not both"),
        ({"tokens_per_chip": 0}, "tokens_per_chip must be > 0"),
        ({"nodes": (0,)}, "nodes integers >= 1"),
        ({"bandwidths_gbit": (-1,)}, "bandwidths must be > 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sm.predict(ROWS, **kwargs)


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
    assert fp["predicted_s"]["serial"] == pytest.approx(0.9) and fp["rel_error"]["serial"] == pytest.approx(-0.1)
    assert fp["predicted_s"]["overlapped"] == pytest.approx(0.5)  # max(0.5, 0.4)
    assert q["measured_s"] == pytest.approx(0.7) and q["predicted_s"]["serial"] == pytest.approx(0.7)
    assert q["rel_error"]["serial"] == pytest.approx(0.0, abs=1e-12)
    assert out["mean_abs_rel_error"]["serial"] == pytest.approx(0.05)
    assert out["unmatched"][0]["config"] == "bf16"
    # each process on its own link: half the bytes through the shaper
    own = sm.check_against_network(path, shared_queue=False)
    assert {p["config"]: p["predicted_s"]["serial"] for p in own["pairs"]}["fp32"] == pytest.approx(0.7)
    assert "mean absolute relative error" in sm.check_table(out)


def test_check_rejects_bad_schema(tmp_path):
    path = tmp_path / "network.json"
    path.write_text(json.dumps({"runs": [{"bandwidth_mbit": 10}]}))
    with pytest.raises(ValueError):
        sm.check_against_network(path)


def test_table_plot_and_main(tmp_path):
    preds = sm.predict([{**r, "model": "gpt-1.3b"} for r in ROWS], nodes=(2, 4))
    text = sm.table(preds)
    assert "gpt-1.3b" in text and "W8G8+2level" in text and "MODEL" in text
    sm.plot(preds, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    (tmp_path / "aot.json").write_text(json.dumps({"rows": ROWS, "commands": ["x"]}))
    out = tmp_path / "out"
    assert (
        sm.main(
            [
                "--aot",
                str(tmp_path / "aot.json"),
                "--nodes",
                "2",
                "4",
                "--network-json",
                "/nonexistent",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "speedup_model.json").read_text())
    assert len(doc["predictions"]) == 4 * 3 * 2 and doc["network_check"]["skipped"]
