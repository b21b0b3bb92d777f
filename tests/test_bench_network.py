"""Tests for experiments.bench.network, experiments.shelf.network_results and network_workload.

In-process pieces run on the 8 simulated devices of the test session; one end-to-end run goes
through 2 real jax.distributed processes without a namespace (tiny model, 2 timed repeats).
"""

import json

import pytest

from experiments.bench import network as bn
from experiments.shelf import network_results as nr
from experiments.shelf import network_workload as nw
from experiments.shelf.multiproc import WorkerError, WorkerTimeout

TINY = dict(nw.TINY_MODEL)


# ----------------------------------------------------------------------------- workload


FAST = {"xla_backend_optimization_level": 0}  # halves compile time on a busy 2-core box


@pytest.fixture(scope="module")
def tiny_built():
    """All four configs' steps on a 2-device mesh of this process's simulated devices."""
    import jax

    import qsdp_jax as q

    mesh = q.make_mesh("fsdp", jax.devices()[:2])
    batch = nw.make_batch(mesh, 4, TINY["seq_len"], TINY["vocab_size"])
    return nw.build_steps(TINY, mesh, batch, nw.CONFIG_NAMES, compiler_options=FAST), batch


def test_workload_builds_four_configs_and_counts_bytes(tiny_built):
    import jax
    import numpy as np

    built, batch = tiny_built
    assert list(built) == list(nw.CONFIG_NAMES)
    b = {n: s.bytes_per_device for n, s in built.items()}
    assert all(v > 0 for v in b.values())
    assert b["fp32"] > b["bf16"] > b["qsdp-W8G8"] > b["qsdp-W4G4"]
    assert b["fp32"] > 3 * b["qsdp-W8G8"]
    # quantized configs move their payload as bytes, fp32 as f32
    assert any(k.endswith("/f32") and v > 1e4 for k, v in built["fp32"].bytes_by_kind_dtype.items())
    assert any(k.endswith("/u8") for k in built["qsdp-W8G8"].bytes_by_kind_dtype)
    # steps run and carry their (donated) state; same params -> nearly the same first loss
    losses = {}
    for name, s in built.items():
        old = s.state
        state, metrics = s.step(batch)
        assert s.state is state and int(state.step) == 1
        assert old.step.is_deleted()  # donated
        losses[name] = float(np.asarray(jax.device_get(metrics["loss"])))
    assert all(abs(v - losses["fp32"]) < 0.05 for v in losses.values()), losses


def test_make_batch_is_global_and_sharded():
    import jax
    from jax.sharding import PartitionSpec as P

    import qsdp_jax as q

    mesh = q.make_mesh("fsdp")
    batch = nw.make_batch(mesh, 8, seq_len=16, vocab_size=256, seed=1)
    for k in ("inputs", "targets"):
        x = batch[k]
        assert x.shape == (8, 16) and x.sharding.spec == P("fsdp")
        assert len(x.addressable_shards) == jax.device_count()
    # targets are the inputs shifted by one token
    import numpy as np

    np.testing.assert_array_equal(np.asarray(batch["inputs"])[:, 1:], np.asarray(batch["targets"])[:, :-1])
    with pytest.raises(ValueError, match="multiple"):
        nw.make_batch(mesh, 4, seq_len=16, vocab_size=256)


def test_qsdp_config_names():
    assert nw.qsdp_config("fp32").name == "fp32"
    assert nw.qsdp_config("bf16").name == "bf16"
    assert nw.qsdp_config("qsdp-W8G8").name == "qsdp-W8G8"
    c = nw.qsdp_config("qsdp-W4G4")
    assert (c.weight_bits, c.grad_bits, c.weight_mode) == (4, 4, "qsdp")
    with pytest.raises(ValueError, match="unknown config"):
        nw.qsdp_config("fp64")


# ----------------------------------------------------------------------------- assembly


def _fake_proc(pid, medians, nbytes, jitter=0.0):
    configs = {}
    for name, m in medians.items():
        samples = [m * (1 - 0.1), m, m * (1 + 0.1) + jitter]
        configs[name] = {
            "samples_s": samples,
            "median_s": m,
            "first_call_s": 5.0,
            "compile_s": 2.0,
            "bytes_per_device": nbytes[name],
            "bytes_per_process": nbytes[name],
            "bytes_by_kind_dtype": {},
            "final_loss": 5.5,
        }
    return {
        "process_index": pid,
        "process_count": 2,
        "device_count": 2,
        "local_device_count": 1,
        "model": TINY,
        "n_params": 1234,
        "batch_per_process": 4,
        "global_batch": 8,
        "configs": configs,
    }


NBYTES = {"fp32": 20e6, "bf16": 10e6, "qsdp-W8G8": 5e6, "qsdp-W4G4": 2.5e6}


def _fake_measurements():
    slow = {"fp32": 3.0, "bf16": 1.5, "qsdp-W8G8": 1.0, "qsdp-W4G4": 0.75}
    fast = {"fp32": 0.4, "bf16": 0.4, "qsdp-W8G8": 0.5, "qsdp-W4G4": 0.8}
    return [
        {
            "bandwidth_mbit": 100,
            "netns": "ns1",
            "processes": [_fake_proc(0, slow, NBYTES), _fake_proc(1, slow, NBYTES, jitter=0.3)],
        },
        {"bandwidth_mbit": 1000, "error": "WorkerError: boom"},
        {
            "bandwidth_mbit": None,
            "netns": "ns3",
            "processes": [_fake_proc(0, fast, NBYTES), _fake_proc(1, fast, NBYTES)],
        },
    ]


def test_assemble_results_speedups_and_schema():
    doc = nr.assemble_results(_fake_measurements(), meta={"wall_s": 1.0})
    assert "loopback" in doc["note"] and "TOTAL" in doc["note"]
    runs = doc["runs"]
    assert len(runs) == 8  # the failed bandwidth has no runs
    for r in runs:
        assert r["config"] in nw.CONFIG_NAMES
        assert r["bandwidth_mbit"] in (100, 1000, None)
        assert isinstance(r["step_time_s"], float) and isinstance(r["bytes_per_step"], float)
        assert r["n_processes"] == 2
    by = {(r["bandwidth_mbit"], r["config"]): r for r in runs}
    # medians of the per-call max over processes: [0.9m, m, 1.1m + jitter] -> m
    assert by[(100, "fp32")]["step_time_s"] == pytest.approx(3.0)
    assert by[(100, "qsdp-W8G8")]["speedup_vs_fp32"] == pytest.approx(3.0)
    assert by[(100, "qsdp-W4G4")]["speedup_vs_fp32"] == pytest.approx(4.0)
    assert by[(100, "qsdp-W4G4")]["speedup_vs_bf16"] == pytest.approx(2.0)
    assert by[(100, "fp32")]["speedup_vs_bf16"] == pytest.approx(0.5)
    assert by[(None, "qsdp-W4G4")]["speedup_vs_fp32"] == pytest.approx(0.5)
    assert by[(100, "bf16")]["bytes_per_step"] == 10e6

    bw100 = doc["bandwidths"][0]["configs"]["fp32"]
    assert bw100["max_s"] == pytest.approx(3.3 + 0.3)  # the max over processes per call
    assert bw100["min_s"] == pytest.approx(2.7)
    assert bw100["iqr_s"] == pytest.approx(nr._stats([2.7, 3.0, 3.6])["iqr_s"])
    assert bw100["shaper_bytes_per_step"] == 40e6
    assert bw100["ideal_comm_s"] == pytest.approx(40e6 * 8 / 100e6)
    assert bw100["comm_share_est"] == pytest.approx(1 - 0.4 / 3.0)
    assert bw100["serial_est_s"] == pytest.approx(3.2 + 0.4)
    w4 = doc["bandwidths"][0]["configs"]["qsdp-W4G4"]
    assert w4["serial_est_s"] == pytest.approx(5e6 * 8 / 100e6 + 0.8)
    assert w4["serial_est_speedup_vs_fp32"] == pytest.approx(3.6 / (0.4 + 0.8))
    assert doc["bandwidths"][1]["error"].startswith("WorkerError")

    t = doc["targets"]
    assert t["bandwidth_mbit"] == 100 and t["evaluated"]
    assert t["checks"]["qsdp-W8G8"]["met"] is True and t["checks"]["qsdp-W4G4"]["met"] is True
    assert t["all_met"] is True

    json.dumps(doc, allow_nan=False)  # serialisable as is
    table = nr.format_table(doc)
    assert "100 Mbit/s" in table and "unshaped" in table and "FAILED" in table
    assert "3.00x" in table and "4.00x" in table and "20.00" in table  # MB/step of fp32
    assert "no-overlap estimate" in table and "tbf banks tokens" in table


def test_targets_not_met_and_unshaped_only():
    ms = _fake_measurements()
    ms[0]["processes"] = [
        _fake_proc(p, {"fp32": 1.0, "bf16": 0.8, "qsdp-W8G8": 0.6, "qsdp-W4G4": 0.5}, NBYTES) for p in (0, 1)
    ]
    t = nr.evaluate_targets(nr.assemble_results(ms)["bandwidths"])
    assert t["checks"]["qsdp-W8G8"]["met"] is False and t["checks"]["qsdp-W4G4"]["met"] is False
    assert t["all_met"] is False
    doc = nr.assemble_results([ms[2]])
    assert doc["targets"]["evaluated"] is False
    assert "NOT met" not in nr.format_table(doc)


def test_parse_bandwidth():
    assert nr.parse_bandwidth("100") == 100 and isinstance(nr.parse_bandwidth("100"), int)
    assert nr.parse_bandwidth("2.5") == 2.5
    assert nr.parse_bandwidth("none") is None and nr.parse_bandwidth("Unshaped") is None
    for bad in ("0", "-3", "fast", "nan"):
        with pytest.raises(Exception):
            nr.parse_bandwidth(bad)


# ----------------------------------------------------------------------------- CLI


def test_cli_exits_cleanly_without_netns_support(monkeypatch, tmp_path, capsys):
    import experiments.shelf.multiproc as mp
    import experiments.shelf.netns as netns

    monkeypatch.setattr(netns, "check_netns_support", lambda *a, **k: "network namespaces need root (test)")

    def no_run(*a, **k):
        raise AssertionError("must not start processes")

    monkeypatch.setattr(mp, "run_processes", no_run)
    out = tmp_path / "network.json"
    rc = bn.main(["--out", str(out)])
    assert rc == bn.EXIT_NETNS_UNAVAILABLE == 0
    err = capsys.readouterr().err
    assert "need root (test)" in err and "--no-netns" in err
    assert not out.exists()


def test_cli_rejects_bad_bandwidth(capsys):
    assert bn.main(["--bandwidths", "fast"]) == 2
    assert "bandwidth" in capsys.readouterr().err


_ENV_SIGNS = (
    "Address already in use",
    "Failed to add port",
    "gloo",
    "Connection refused",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "Operation not permitted",
)


@pytest.mark.slow
def test_end_to_end_two_processes_no_netns(tmp_path, monkeypatch, capsys):
    """The real CLI: 2 jax.distributed processes on the host loopback, tiny model."""
    import experiments.shelf.multiproc as mp

    real = mp.run_processes
    errors = []

    def guarded(*a, **k):
        try:
            return real(*a, **k)
        except WorkerError as e:  # WorkerTimeout included
            errors.append(e)
            raise

    monkeypatch.setattr(mp, "run_processes", guarded)
    out = tmp_path / "network.json"
    # Two of the four configs (bf16 is fp32's code path, W8G8 W4G4's at other bits; the
    # workload test builds all four): each process compiles every config it is given, which is
    # most of this test's time.
    configs = ["fp32", "qsdp-W4G4"]
    argv = [
        "--no-netns",
        "--bandwidths",
        "100",
        "none",
        "--configs",
        *configs,
        "--out",
        str(out),
        "--d-model",
        str(TINY["d_model"]),
        "--n-layers",
        str(TINY["n_layers"]),
        "--n-heads",
        str(TINY["n_heads"]),
        "--seq-len",
        str(TINY["seq_len"]),
        "--batch-per-process",
        "2",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--timeout",
        "240",
        "--fast-compile",
    ]
    rc = bn.main(argv)
    if rc != 0 and errors:
        e = errors[0]
        text = str(e) + "".join(e.stderr_tails.values())
        if isinstance(e, WorkerTimeout) or any(s in text for s in _ENV_SIGNS):
            pytest.skip(f"multi-process JAX unavailable here: {text[-500:]}")
    assert rc == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "unshaped" in printed and "qsdp-W4G4" in printed

    doc = json.loads(out.read_text())
    assert doc["netns"] is False and doc["n_processes"] == 2
    assert [b["bandwidth_mbit"] for b in doc["bandwidths"]] == [None]  # shaped ones dropped
    runs = {r["config"]: r for r in doc["runs"]}
    assert set(runs) == set(configs)
    for r in runs.values():
        assert r["bandwidth_mbit"] is None and r["n_processes"] == 2
        assert r["step_time_s"] > 0 and r["bytes_per_step"] > 0
    assert runs["fp32"]["speedup_vs_fp32"] == pytest.approx(1.0)
    assert runs["fp32"]["bytes_per_step"] > runs["qsdp-W4G4"]["bytes_per_step"]
    cfg = doc["bandwidths"][0]["configs"]["fp32"]
    assert len(cfg["samples_s"]) == 2 and len(cfg["per_process_median_s"]) == 2
    assert doc["targets"]["evaluated"] is False
    assert doc["model"]["d_model"] == TINY["d_model"] and doc["global_batch"] == 4
    assert doc["fast_compile"] is True


def test_workload_optimizer_clips_by_the_global_norm():
    """The workload's optimizer clips by the norm over all devices (qsdp_jax.optim's clip), not
    by each device's shards (optax's inside the sharded step): its steps match one device
    running optax's chain on the global batch, with the gradients large enough to be clipped."""
    import jax
    import numpy as np
    import optax

    import qsdp_jax as q
    import toymodel

    mesh = q.make_mesh(devices=jax.devices()[:8])
    cfg = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=128)
    opt = nw._optimizer(cfg, lr=1e-2)

    def loss(p, b):  # x100: the global gradient norm is far above the clip threshold 1.0
        return 100.0 * toymodel.loss(p, b)

    state = q.init_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(loss, opt, mesh, cfg)
    ref_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b2=0.99))
    params = toymodel.init(0)
    ref_state = ref_opt.init(params)
    for i in range(3):
        b = toymodel.batch(i)
        state, _ = step(state, b)
        g = jax.grad(lambda p: loss(q.LocalParams(p), b))(params)  # noqa: B023  (run in this iteration)
        assert float(optax.tree.norm(g)) > 1.0
        u, ref_state = ref_opt.update(g, ref_state, params)
        params = optax.apply_updates(params, u)
    for a, b in zip(jax.tree.leaves(q.gather_params(state)), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
