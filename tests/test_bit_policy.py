"""Per-leaf bit policies (QSDPConfig.bit_policy, qsdp_jax._src.layout.policy): config checks, the layout's
buffers, DESIGN.md invariants 2-5 for a policy config, summaries, the trainer flag, NNX."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
import toymodel
from qsdp_jax import comm, optim
from qsdp_jax import nnx as qnnx
from qsdp_jax.checkpoint import CheckpointMismatch, Checkpointer
from qsdp_jax.collectives import payload_size
from qsdp_jax.layout import ParamLayout

N = 8
BUCKET = 64
SMALL = dict(bucket_size=BUCKET, min_shard_size=128)  # embed/b and blocks/s stay replicated
# W4G4 in the blocks; the embedding at W8G8; the head at full precision (fp32, no grid)
POLICY = (("embed*", 8, 8), ("head/*", None, None))
SR = dict(weight_rounding="stochastic")


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _setup(mesh, config, opt=None, loss=toymodel.loss, **kw):
    opt = opt or optim.qsdp(optax.adam(1e-2), config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    return state, q.make_train_step(loss, opt, mesh, config, donate=False, **kw), opt


# --- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bit_policy="embed*=8,8"), r"QSDPConfig\.bit_policy='embed\*=8,8' is invalid: must be a tuple"),
        (dict(bit_policy=(("embed*", 8),)), r"bit_policy\[0\]=\('embed\*', 8\) is invalid: must be a rule"),
        (dict(bit_policy=(("", 8, 8),)), r"bit_policy\[0\].*non-empty string"),
        (
            dict(bit_policy=(("a*", 9, 8),)),
            r"bit_policy\[0\]=\('a\*', 9, 8\).*weight_bits is None or an integer in 1\.\.8",
        ),
        (dict(bit_policy=(("a*", 8, 0),)), r"grad_bits is None or an integer in 1\.\.8"),
        (dict(bit_policy=(("a*", 8, 8), ("a*", 4, 4))), r"bit_policy\[1\].*could never apply"),
        (
            dict(weight_mode="full", weight_bits=None, bit_policy=(("a*", 8, 8),)),
            r"weight_bits None when weight_mode='full'",
        ),
        (dict(fp_comm_dtype="bfloat16", bit_policy=(("a*", None, 8),)), r"bit_policy\[0\].*lossless only in 'float32'"),
        (dict(weight_rounding="shift", bit_policy=(("a*", 1, 8),)), r"bit_policy\[0\].*weight_bits 2\.\.8"),
    ],
)
def test_config_refuses_bad_policies_naming_the_rule(kw, match):
    with pytest.raises(ValueError, match=match):
        q.QSDPConfig(**{**SMALL, **kw})


def test_config_policy_is_hashable_and_named():
    cfg = q.QSDPConfig(**SMALL, **SR, weight_bits=4, grad_bits=4, bit_policy=[["embed*", 8, 8], ["h*", None, 4]])
    assert cfg.bit_policy == (("embed*", 8, 8), ("h*", None, 4)) and hash(cfg)
    assert cfg.name == "qsdp-sr-W4G4-pW8G8-pWFG4"
    assert q.QSDPConfig(**SMALL).name == "qsdp-sr-W8G8"  # no policy: no suffix
    # comm mode: None weights are a full-precision buffer; full mode takes gradient rules
    assert q.QSDPConfig(weight_mode="comm", bit_policy=(("a*", None, 2),)).buffer_config(None, 2).weight_mode == "full"
    q.QSDPConfig.fp32(bit_policy=(("a*", None, 8),))


# --- layout --------------------------------------------------------------------------------------
def test_no_policy_layout_is_unchanged_and_restating_rules_change_nothing():
    params = toymodel.init(0)
    plain = ParamLayout.create(params, N, BUCKET, 128, toymodel.STACKED)
    restated = ParamLayout.create(params, N, BUCKET, 128, toymodel.STACKED, (("*", 4, 4),), (4, 4))
    assert restated == plain
    assert [b.key for b in plain.buffers] == ["blocks", "embed", "head"]
    assert all(b.bits is None and b.index == 0 for b in plain.buffers)


def test_restating_rules_train_bit_identically_to_no_policy(mesh):
    """A policy whose rules restate the global bits runs the policy code path (per-leaf bits in
    the optimizer) and gives bit-identical losses and weights to the policy-less config."""
    plain = q.QSDPConfig.qsdp(4, 4, **SR, **SMALL)
    restated = dataclasses.replace(plain, bit_policy=(("embed*", 4, 4), ("*", 4, 4)))
    runs = []
    for cfg in (plain, restated):
        state, step, _ = _setup(mesh, cfg)
        losses = []
        for i in range(2):
            state, m = step(state, toymodel.batch(i))
            losses.append(float(m["loss"]))
        runs.append((losses, jax.tree.leaves(state.params)))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_policy_splits_groups_into_buffers_and_round_trips():
    params = toymodel.init(0)
    lay = ParamLayout.create(params, N, BUCKET, 128, toymodel.STACKED, POLICY, (4, 4))
    assert [(b.key, b.bits, b.index) for b in lay.buffers] == [
        ("blocks", None, 0),
        ("embed@W8G8", (8, 8), 1),
        ("head@WFGF", (None, None), 1),
    ]
    assert [b.key for b in lay.group("embed").buffers] == ["embed@W8G8"] and lay.group("embed").is_sharded
    assert lay.weight_bits(q.QSDPConfig.qsdp(4, 4, bit_policy=POLICY, **SMALL)) == [None, 4, None, 8, None]


def test_a_rule_that_matches_no_sharded_leaf_is_an_error(mesh):
    params = toymodel.init(0)
    with pytest.raises(
        ValueError,
        match=r"bit_policy\[1\]=\('emb\*/kernel', 8, 8\) matches no sharded "
        r"leaf: it matches no leaf.*sharded leaves are: blocks/w, embed/w, head/w",
    ):
        ParamLayout.create(params, N, BUCKET, 128, toymodel.STACKED, (("head*", 8, 8), ("emb*/kernel", 8, 8)), (4, 4))
    cfg = q.QSDPConfig(**SMALL, bit_policy=(("embed/b", 4, 4),))  # the bias is replicated
    with pytest.raises(ValueError, match=r"matches only replicated leaves \['embed/b'\].*counts as matching nothing"):
        q.init_train_state(params, optim.qsdp(optax.adam(1e-2), cfg), mesh, cfg, stacked=toymodel.STACKED)


# --- invariants ----------------------------------------------------------------------------------
def _unique_per_bucket(x):
    rows = np.asarray(x).reshape(-1, BUCKET)
    return max(len(np.unique(r)) for r in rows)


@pytest.mark.parametrize("rounding", ["shift", "stochastic"])
def test_gather_is_lossless_per_buffer(mesh, rounding):
    """Invariant 2 with a policy: every device computes with the optimizer's weights bit for bit,
    each buffer on the grid of its own bits (the head in fp32, without a grid)."""
    cfg = q.QSDPConfig.qsdp(4, 4, weight_rounding=rounding, bit_policy=POLICY, **SMALL)
    state, step, _ = _setup(mesh, cfg, loss=toymodel.loss_with_weights, has_aux=True)
    for i in range(3):
        held = q.gather_params(state)
        state, metrics, aux = step(state, toymodel.batch(i))
        assert int(metrics["nonfinite"]) == 0
        for dev in range(N):
            for name in ("embed", "head", "blocks"):
                np.testing.assert_array_equal(
                    np.asarray(aux[name][dev]).view(np.uint32), np.asarray(held[name]["w"]).view(np.uint32)
                )
    p = state.params  # each device's block of these leaves is whole rows of buckets
    assert _unique_per_bucket(p["blocks"]["w"]) <= 16
    assert 16 < _unique_per_bucket(p["embed"]["w"]) <= 256
    assert _unique_per_bucket(p["head"]["w"]) > 16  # fp32: no grid
    st = optim.find_qsdp_state(state.opt_state)
    assert st.scales["head"]["w"].size == 0  # no grid kept for full precision


def _wire(report, kind, dtype):
    return report.by_kind_dtype().get((kind, dtype), 0.0)


def test_wire_bytes_match_the_formula_per_buffer(mesh):
    """Invariant 4: per buffer, n*bits/8 + scales with that buffer's bits (the head at fp32)."""
    cfg = q.QSDPConfig.qsdp(4, 4, bit_policy=(("embed*", 8, 8), ("head/*", 2, None)), **SR, **SMALL)
    state, step, _ = _setup(mesh, cfg)
    report = comm.comm_report(step, state, toymodel.batch(0))
    ag = a2a = f32_rs = 0.0
    for b in state.layout.buffers:
        wb, gb = b.resolved_bits(cfg)
        gathers, scatters = (2 * b.n_layers, b.n_layers) if b.stacked else (1, 1)
        ag += gathers * (N - 1) * payload_size(b.chunk, wb, BUCKET)
        if gb is None:
            f32_rs += scatters * (N - 1) * 4 * b.chunk
        else:
            a2a += scatters * (N - 1) * payload_size(b.chunk, gb, BUCKET)
    assert abs(_wire(report, "all-gather", "u8") - ag) <= 0.01 * ag
    assert abs(_wire(report, "all-to-all", "u8") - a2a) <= 0.01 * a2a
    assert abs(_wire(report, "reduce-scatter", "f32") - f32_rs) <= 0.01 * f32_rs
    assert _wire(report, "all-gather", "f32") == 0


def _sgd_grads(mesh, cfg, state, steps):
    """Per step key, the sharded gradient of every buffer (SGD with lr 1: old - new weights)."""
    opt = optim.qsdp(optax.sgd(1.0), cfg)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg, donate=False)
    by_name = lambda p: {k: np.asarray(p[k]["w"]) for k in ("blocks", "embed")}  # noqa: E731
    old = by_name(state.params)
    out = []
    for s in steps:
        new, _ = step(dataclasses.replace(state, step=jnp.int32(s)), toymodel.batch(0))
        out.append({k: old[k] - v for k, v in by_name(new.params).items()})
    return out


def test_gradient_reduce_scatter_is_unbiased_per_buffer(mesh):
    """Invariant 3 with a policy: each buffer's quantized gradient averages to the exact one like
    1/sqrt(keys), and the 8-bit buffer's single draw is far closer than the 2-bit one's."""
    cfg = q.QSDPConfig(weight_mode="full", weight_bits=None, grad_bits=2, bit_policy=(("embed*", None, 8),), **SMALL)
    exact_cfg = q.QSDPConfig.fp32(**SMALL)
    opt = optim.qsdp(optax.sgd(1.0), cfg)
    state = q.init_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    exact_state = q.init_train_state(
        toymodel.init(0), optim.qsdp(optax.sgd(1.0), exact_cfg), mesh, exact_cfg, stacked=toymodel.STACKED
    )
    (exact,) = _sgd_grads(mesh, exact_cfg, exact_state, [0])
    draws = _sgd_grads(mesh, cfg, state, range(64))
    rel = {}
    for key, ref in (("blocks", exact["blocks"]), ("embed", exact["embed"])):
        d = np.stack([x[key] for x in draws])
        rms = lambda e: np.sqrt(np.mean(e**2))  # noqa: E731
        ratio = rms(d[:4].mean(0) - ref) / rms(d.mean(0) - ref)  # 4 for an unbiased estimator
        assert 2.0 < ratio < 8.0, (key, ratio)
        rel[key] = rms(d[0] - ref) / rms(ref)
    assert rel["embed"] < 0.05 * rel["blocks"], rel  # the embedding's buffer is embed@WFG8


def test_resume_is_bit_exact_with_a_policy(mesh, tmp_path):
    """Invariant 5: k steps + save + restore + k steps == 2k steps, bit for bit; another policy
    is refused naming the field."""
    cfg = q.QSDPConfig.qsdp(4, 4, bit_policy=POLICY, **SR, **SMALL)
    state0, step, opt = _setup(mesh, cfg)
    straight = half = state0
    losses = []
    for i in range(4):
        straight, m = step(straight, toymodel.batch(i))
        losses.append(float(m["loss"]))
        if i == 1:
            half = straight
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(half, cfg, mesh)
        fresh = q.init_train_state(toymodel.init(1), opt, mesh, cfg, stacked=toymodel.STACKED)
        restored, _ = ckpt.restore(fresh, cfg, mesh)
        other = dataclasses.replace(cfg, bit_policy=(("embed*", 6, 6),))
        other_state = q.init_train_state(
            toymodel.init(0), optim.qsdp(optax.adam(1e-2), other), mesh, other, stacked=toymodel.STACKED
        )
        with pytest.raises(CheckpointMismatch, match=r"config\.bit_policy"):
            ckpt.restore(other_state, other, mesh)
        mesh4 = q.make_mesh(devices=jax.devices()[:4])  # and resharded onto 4 devices
        on4, _ = ckpt.restore(
            q.init_train_state(toymodel.init(1), opt, mesh4, cfg, stacked=toymodel.STACKED), cfg, mesh4
        )
    for a, b in zip(jax.tree.leaves(q.gather_params(on4)), jax.tree.leaves(q.gather_params(half)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed = restored
    for i in (2, 3):
        resumed, m = step(resumed, toymodel.batch(i))
        assert float(m["loss"]) == losses[i]
    for a, b in zip(
        jax.tree.leaves((resumed.params, resumed.opt_state)),
        jax.tree.leaves((straight.params, straight.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_single_device_optimizer_follows_the_policy():
    """``qsdp_jax.optim`` on its own matches the rules on the parameter tree's paths."""
    cfg = q.QSDPConfig.qsdp(2, 4, bit_policy=(("embed/*", 8, 8),), **SR, **SMALL)
    params, _ = optim.init_on_grid(toymodel.init(0), optim.qsdp(optax.adam(1e-2), cfg), cfg)
    assert 4 < _unique_per_bucket(params["embed"]["w"]) <= 256
    assert _unique_per_bucket(params["blocks"]["w"]) <= 4


# --- summaries, the trainer flag, NNX ------------------------------------------------------------
def test_summaries_show_the_bits():
    lay = ParamLayout.create(toymodel.init(0), N, BUCKET, 128, toymodel.STACKED, POLICY, (4, 4))
    table = lay.table()
    assert "embed/w" in table and "embed@W8G8" in table and "head@WFGF" in table
    cfg = q.QSDPConfig.qsdp(4, 4, bit_policy=POLICY, **SMALL)
    line = [r for r in lay.bits_table(cfg).splitlines() if r.startswith("blocks/w")][0]
    assert line.split()[2:4] == ["4", "4"]
    assert [r for r in lay.bits_table(cfg).splitlines() if r.startswith("head/w")][0].split()[2:4] == ["fp", "fp"]
    assert "embed@" not in ParamLayout.create(toymodel.init(0), N, BUCKET, 128, toymodel.STACKED).table()
    from experiments.gpt.report import summary_text

    summary = dict(
        name="x",
        n_params=1,
        n_devices=8,
        steps=1,
        train_loss=1.0,
        val_loss=1.0,
        tokens_per_s=1.0,
        setup_s=0.0,
        wall_s=0.0,
        wire_bytes_per_step=1.0,
        nonfinite_steps=0,
        out_dir="o",
        bit_policy={"rules": "embed*=8,8", "table": lay.bits_table(cfg)},
    )
    assert "bit policy     embed*=8,8" in summary_text(summary, None) and "embed@W8G8" in summary_text(summary, None)


def test_trainer_flag_parses_and_errors_clearly():
    from experiments.gpt.arg_types import parse_bit_policy
    from experiments.gpt.args import CLIError, parse_args, qsdp_kwargs
    from experiments.gpt.setup import build_run_config

    args = parse_args(["--bit-policy", "embed*=8,8; blocks/*/kernel=4,none", "--weight-bits", "3"])
    assert qsdp_kwargs(args)["bit_policy"] == (("embed*", 8, 8), ("blocks/*/kernel", 4, None))
    assert qsdp_kwargs(parse_args([]))["bit_policy"] == ()
    for bad, msg in (
        ("embed*=9,8", "expected an integer 1..8 or 'none', got 9"),
        ("embed*", "expected PATTERN=WEIGHT_BITS,GRAD_BITS"),
        ("=8,8", "expected PATTERN=WEIGHT_BITS,GRAD_BITS"),
        (";", "no rule"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--bit-policy", bad])
        with pytest.raises(Exception, match=msg.replace(".", r"\.").replace("*", r"\*")):
            parse_bit_policy(bad)
    with pytest.raises(CLIError, match=r"bit_policy\[0\].*weight_mode='full'"):
        build_run_config(parse_args(["--fp32", "--bit-policy", "embed*=8,8"]))
    cfg, run = build_run_config(parse_args(["--bit-policy", "embed*=8,8"]))
    assert run.as_dict()["qsdp"]["bit_policy"] == (("embed*", 8, 8),)


class TinyLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 32, rngs=rngs)
        self.body = nnx.Linear(32, 32, rngs=rngs)
        self.out = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jnp.tanh(self.body(self.embed(tokens))))


def test_nnx_front_door_trains_with_a_policy(mesh):
    cfg = q.QSDPConfig.qsdp(3, 3, bucket_size=BUCKET, min_shard_size=256, bit_policy=(("embed/*", 8, 8),), **SR)
    model = TinyLM(nnx.Rngs(0))
    opt = optim.qsdp(optax.adam(3e-2), cfg)

    def loss_fn(m, batch):
        logits = m(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"]).mean()

    state = qnnx.init_state(model, opt, mesh, cfg)
    step = qnnx.make_train_step(model, loss_fn, opt, mesh, cfg)
    batch = {"x": jnp.arange(64, dtype=jnp.int32).reshape(16, 4) % 32}
    assert "embed@W8G8" in step.summary(state, batch) and "embed/embedding" in step.summary(state, batch)
    losses = []
    for _ in range(8):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert {b.key for b in state.layout.buffers} == {"body", "embed@W8G8", "out"}
    p = state.params
    assert 8 < _unique_per_bucket(p["embed"]["embedding"]) <= 256
    assert _unique_per_bucket(p["body"]["kernel"]) <= 8
    qnnx.update(model, state)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), np.asarray(p["embed"]["embedding"]))


def test_two_level_mesh_with_a_policy():
    """On a (node, local) mesh a policy buffer's gather is lossless on all 8 devices (its bits on
    both levels) and the step lowers for TPU with packed collectives."""
    hmesh = q.make_mesh({"node": 2, "local": 4})
    cfg = q.QSDPConfig.qsdp(
        4, 4, inter_grad_bits=2, axis_name="local", node_axis="node", bit_policy=POLICY, **SR, **SMALL
    )
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.init_train_state(toymodel.init(0), opt, hmesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss_with_weights, opt, hmesh, cfg, has_aux=True, donate=False)
    for i in range(2):
        held = q.gather_params(state)
        state, _, aux = step(state, toymodel.batch(i))
        for dev in range(N):
            for name in ("embed", "head", "blocks"):
                np.testing.assert_array_equal(
                    np.asarray(aux[name][dev]).view(np.uint32), np.asarray(held[name]["w"]).view(np.uint32)
                )
    abstract = q.abstract_train_state(toymodel.init(0), opt, hmesh, cfg, stacked=toymodel.STACKED)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), toymodel.batch(0))
    module = jax.export.export(step, platforms=["tpu"])(abstract, batch).mlir_module()
    assert "ui8>" in module
