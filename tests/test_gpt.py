"""Tests for experiments/gpt/model.py: config, init, forward through ParamAccess, training."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.gpt import model as gpt
from experiments.gpt.model import GPT, GPTConfig
import qsdp_jax as q
from qsdp_jax.access import LocalParams

TINY = dict(seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _tokens(key, shape):
    return jax.random.randint(jax.random.key(key), shape, 0, 256, dtype=jnp.int32)


def _batch(B=2, L=16, seed=0):
    return {"inputs": _tokens(seed, (B, L)), "targets": _tokens(seed + 1, (B, L))}


@pytest.fixture(scope="module")
def model():
    return GPT(GPTConfig(**TINY))


@pytest.fixture(scope="module")
def params(model):
    return model.init_params(0)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("seq_len", 0, "positive"),
        ("d_model", -8, "positive"),
        ("n_layers", 0, "positive"),
        ("n_heads", 0, "positive"),
        ("d_ff", 0, "positive"),
        ("vocab_size", 0, "positive"),
        ("n_layers", 2.0, "int"),
        ("n_heads", True, "int"),
        ("tie_embeddings", 1, "bool"),
        ("dtype", "int32", "floating"),
        ("param_dtype", "not-a-dtype", "dtype"),
        ("embed_lookup", "rows", "one of ('gather', 'take')"),
    ],
)
def test_config_rejects_bad_field(field, value, rule):
    with pytest.raises(ValueError) as e:
        GPTConfig(**{**TINY, field: value})
    msg = str(e.value)
    assert field in msg and repr(value).strip("'") in msg and rule in msg, msg


def test_config_heads_must_divide_d_model():
    with pytest.raises(ValueError, match=r"d_model=30.*n_heads=4.*d_model % n_heads == 0"):
        GPTConfig(**{**TINY, "d_model": 30})


def test_config_defaults_and_normalisation():
    cfg = GPTConfig(**TINY, dtype=jnp.bfloat16)
    assert cfg.d_ff == 4 * cfg.d_model
    assert cfg.vocab_size == 256 and cfg.tie_embeddings
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
    assert cfg.head_dim == 8
    assert hash(cfg) == hash(GPTConfig(**TINY, dtype="bfloat16"))
    assert GPT(cfg) == GPT(GPTConfig(**TINY, dtype="bfloat16"))


def test_from_preset():
    assert GPTConfig.from_preset("tiny") == gpt.PRESETS["tiny"]
    cfg = GPTConfig.from_preset("small", n_layers=2, d_model=128)
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.seq_len) == (2, 128, 512, 128)
    assert GPTConfig.from_preset("gpt-125m").vocab_size == 50304
    with pytest.raises(ValueError, match=r"unknown GPT preset 'huge'.*'medium'.*'small'.*'tiny'"):
        GPTConfig.from_preset("huge")
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig.from_preset("tiny", n_layer=3)
    with pytest.raises(ValueError, match="d_model % n_heads"):
        GPTConfig.from_preset("tiny", n_heads=3)


@pytest.mark.parametrize(
    "name, lo, hi",
    [
        ("tiny", 0.35e6, 0.5e6),
        ("small", 2.9e6, 3.6e6),
        ("medium", 23e6, 28e6),
        ("gpt-125m", 115e6, 135e6),
        ("gpt-350m", 330e6, 380e6),
        ("gpt-1.3b", 1.2e9, 1.45e9),
    ],
)
def test_preset_param_counts(name, lo, hi):
    cfg = GPTConfig.from_preset(name)
    abstract = gpt.abstract_params(cfg)  # shapes only, nothing allocated
    n = gpt.count_params(abstract)
    assert lo <= n <= hi, (name, n)
    # Closed form: blocks + token/position embeddings + final norm (+ untied head).
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    expected = L * per_layer + (cfg.vocab_size + cfg.seq_len) * d + 2 * d
    assert n == expected
    untied = gpt.count_params(gpt.abstract_params(GPTConfig.from_preset(name, tie_embeddings=False)))
    assert untied == expected + d * cfg.vocab_size


def test_flops_per_token():
    cfg = GPTConfig(**TINY)
    d, f, L, S, V = 32, 128, 2, 16, 256
    assert gpt.flops_per_token(cfg) == 6 * (L * (4 * d * d + 2 * d * f) + V * d) + 12 * L * d * S
    big = gpt.flops_per_token(GPTConfig.from_preset("gpt-125m"))
    n = gpt.count_params(gpt.abstract_params(GPTConfig.from_preset("gpt-125m")))
    assert 6 * n * 0.9 < big < 6 * n * 1.3  # roughly 6N


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------


def _assert_pure(tree):
    """Nested dicts with string keys, jax array leaves, no nnx objects."""
    assert type(tree) is dict
    for k, v in tree.items():
        assert isinstance(k, str)
        if isinstance(v, dict):
            _assert_pure(v)
        else:
            assert isinstance(v, jax.Array), (k, type(v))


def test_init_structure_and_determinism(model, params):
    cfg = model.cfg
    assert set(params) == {"embed", "blocks", "head"} == set(GPT.groups)
    _assert_pure(params)
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == cfg.n_layers
    chex.assert_shape(params["embed"]["tok"]["embedding"], (256, 32))
    chex.assert_shape(params["embed"]["pos"]["embedding"], (16, 32))
    chex.assert_shape(params["blocks"]["attn"]["q"]["kernel"], (2, 32, 32))
    chex.assert_shape(params["blocks"]["mlp"]["fc"]["kernel"], (2, 32, 128))
    assert set(params["head"]) == {"ln_f"}  # tied: no output kernel
    chex.assert_trees_all_equal(params, model.init_params(0))
    other = model.init_params(1)
    assert not np.allclose(params["blocks"]["attn"]["q"]["kernel"], other["blocks"]["attn"]["q"]["kernel"])
    # Layers are initialised independently.
    q = params["blocks"]["attn"]["q"]["kernel"]
    assert not np.allclose(q[0], q[1])
    # A typed key works as a seed too, and init traces under jit.
    chex.assert_trees_all_equal(params, model.init_params(jax.random.key(0)))
    chex.assert_trees_all_close(params, jax.jit(model.init_params)(0))
    # abstract_params matches
    chex.assert_trees_all_equal_shapes_and_dtypes(params, model.abstract_params())


def test_rebuild_round_trips(model, params):
    """A module rebuilt from a pure dict holds exactly those arrays, at the same paths."""
    layer1 = jax.tree.map(lambda a: a[1], params["blocks"])
    block = model.block(layer1)
    assert isinstance(block, gpt.Block)
    chex.assert_trees_all_equal(gpt._to_pure(block), layer1)
    chex.assert_trees_all_equal(gpt._to_pure(model.embedding(params["embed"])), params["embed"])
    chex.assert_trees_all_equal(gpt._to_pure(model.head(params["head"])), params["head"])


def test_small_leaves():
    small = gpt.small_leaves(gpt.abstract_params(GPTConfig.from_preset("tiny")))
    assert "blocks/ln1/scale" in small and "blocks/attn/q/bias" in small
    assert "blocks/mlp/fc/bias" in small and "head/ln_f/bias" in small
    assert "blocks/attn/q/kernel" not in small and "embed/tok/embedding" not in small


# ---------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_loss_at_init_is_near_uniform(tie):
    model = GPT(GPTConfig(**TINY, tie_embeddings=tie))
    params = model.init_params(0)
    assert ("out" in params["head"]) == (not tie)
    if not tie:
        chex.assert_shape(params["head"]["out"]["kernel"], (32, 256))
    batch = _batch(B=4)

    @jax.jit
    def f(p, b):
        return model.loss(LocalParams(p), b), model.logits(LocalParams(p), b["inputs"])

    loss, logits = f(params, batch)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - math.log(256)) < 0.3, float(loss)
    chex.assert_shape(logits, (4, 16, 256))
    chex.assert_tree_all_finite(logits)
    chex.assert_trees_all_close(loss, gpt.cross_entropy(logits, batch["targets"]), rtol=1e-6)


def test_causality(model, params):
    inputs = _tokens(3, (2, 16))
    t = 9
    changed = inputs.at[:, t].set((inputs[:, t] + 1) % 256)
    f = jax.jit(lambda p, x: model.logits(LocalParams(p), x))
    a, b = f(params, inputs), f(params, changed)
    chex.assert_trees_all_close(a[:, :t], b[:, :t], atol=1e-6)
    assert np.abs(np.asarray(a[:, t:] - b[:, t:])).max() > 1e-4


def test_shorter_sequences_and_length_check(model, params):
    x = _tokens(0, (2, 5))
    f = jax.jit(lambda p, x: model.logits(LocalParams(p), x))
    full = f(params, _tokens(0, (2, 16)).at[:, :5].set(x))
    short = f(params, x)
    chex.assert_trees_all_close(short, full[:, :5], atol=1e-5)
    with pytest.raises(ValueError, match="seq_len=16"):
        model.logits(LocalParams(params), _tokens(0, (2, 17)))
    with pytest.raises(ValueError, match="targets"):
        model.loss(LocalParams(params), {"inputs": x, "targets": _tokens(0, (2, 4))})
    with pytest.raises(ValueError, match="'inputs' and 'targets'"):
        model.loss(LocalParams(params), {"inputs": x})


def _unrolled_logits(model, params, inputs):
    """Reference forward: apply each layer's Block in a Python loop (no scan)."""
    x = model.embedding(params["embed"])(inputs)
    for i in range(model.cfg.n_layers):
        layer = jax.tree.map(lambda a: a[i], params["blocks"])  # noqa: B023  (run in this iteration)
        x = model.block(layer)(x)
    head = model.head(params["head"])
    h = head.ln_f(x)
    if model.cfg.tie_embeddings:
        return h @ params["embed"]["tok"]["embedding"].T
    return h @ params["head"]["out"]["kernel"]


@pytest.mark.parametrize("tie", [True, False])
def test_scan_matches_unrolled(tie):
    model = GPT(GPTConfig(**{**TINY, "n_layers": 3}, tie_embeddings=tie))
    params = model.init_params(7)
    inputs = _tokens(5, (2, 16))
    scanned = jax.jit(lambda p, x: model.logits(LocalParams(p), x))(params, inputs)
    unrolled = jax.jit(lambda p, x: _unrolled_logits(model, p, x))(params, inputs)
    chex.assert_trees_all_close(scanned, unrolled, atol=1e-5, rtol=1e-5)


def test_recreated_leaves_and_access_pattern(model, params):
    """The train step may flatten/re-create leaves; the loss only uses gather/scan."""
    leaves, treedef = jax.tree.flatten(params)
    recreated = jax.tree.unflatten(treedef, [jnp.array(np.asarray(l)) for l in leaves])
    batch = _batch()

    calls = []

    class Recording(LocalParams):
        def gather(self, group):
            calls.append(("gather", group))
            return super().gather(group)

        def scan(self, group, body, init, xs=None, *, remat=True):
            calls.append(("scan", group))
            return super().scan(group, body, init, xs, remat=remat)

    a = jax.jit(lambda p: model.loss(Recording(p), batch))(recreated)
    b = jax.jit(lambda p: model.loss(LocalParams(p), batch))(params)
    chex.assert_trees_all_close(a, b)
    assert ("scan", "blocks") in calls and ("gather", "embed") in calls and ("gather", "head") in calls
    assert ("gather", "blocks") not in calls

    bad = {**params, "head": {"ln_f": {"scale": params["head"]["ln_f"]["scale"]}}}
    with pytest.raises(ValueError, match="structure"):
        jax.eval_shape(lambda p: model.loss(LocalParams(p), batch), bad)


@pytest.mark.parametrize("tie", [True, False])
def test_embed_lookup_take_reads_the_same_rows(tie):
    """``embed_lookup="take"``: ``p.take`` rows instead of the gathered table, the same logits bit
    for bit on one device (``jnp.take`` either way), and the same gradients."""
    cfg = GPTConfig(**TINY, tie_embeddings=tie)
    gather, take = GPT(cfg), GPT(dataclasses.replace(cfg, embed_lookup="take"))
    params, batch = gather.init_params(0), _batch()
    inputs = batch["inputs"]
    np.testing.assert_array_equal(gather.logits(LocalParams(params), inputs), take.logits(LocalParams(params), inputs))
    grads = [jax.grad(lambda p, m=m: m.loss(LocalParams(p), batch))(params) for m in (gather, take)]
    chex.assert_trees_all_close(*grads, rtol=1e-6, atol=1e-7)


def test_embed_lookup_take_in_the_sharded_step_never_gathers_for_the_lookup():
    """Sharded (8 devices, fp32, untied): the same first loss as gathering the table, which the
    step then never holds whole (the rows are taken, the small position table gathered alone)."""
    cfg = GPTConfig(**{**TINY, "vocab_size": 1024}, tie_embeddings=False)
    mesh, config = q.make_mesh(), q.QSDPConfig.fp32()
    batch = {k: v[:8] for k, v in _batch(B=8).items()}
    out = {}
    for lookup in ("gather", "take"):
        model = GPT(dataclasses.replace(cfg, embed_lookup=lookup))
        opt = q.optim.qsdp(optax.adam(1e-3), config)
        state = q.init_train_state(model.init_params(0), opt, mesh, config, stacked=model.stacked_groups)
        compiled = q.make_train_step(model.loss, opt, mesh, config).lower(state, batch).compile()
        out[lookup] = (float(compiled(state, batch)[1]["loss"]), compiled.as_text())
    assert out["take"][0] == out["gather"][0]
    table = "f32[1024,32]"  # the token table, whole
    assert table in out["gather"][1] and table not in out["take"][1]


def test_bfloat16_compute():
    model32 = GPT(GPTConfig(**TINY))
    model16 = GPT(GPTConfig(**TINY, dtype="bfloat16"))
    params = model32.init_params(0)
    batch = _batch()
    l32 = jax.jit(lambda p: model32.loss(LocalParams(p), batch))(params)
    l16 = jax.jit(lambda p: model16.loss(LocalParams(p), batch))(params)
    assert l16.dtype == jnp.float32
    assert abs(float(l16) - float(l32)) < 0.05


# ---------------------------------------------------------------------------------------
# Gradients and training
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_grad_remat_equals_no_remat(tie):
    model = GPT(GPTConfig(**TINY, tie_embeddings=tie))
    params = model.init_params(0)
    batch = _batch()

    @jax.jit
    def grads(p):
        return tuple(
            jax.grad(lambda p: model.loss(LocalParams(p), batch, remat=remat))(p)  # noqa: B023  (run in this iteration)
            for remat in (True, False)
        )

    g1, g0 = grads(params)
    chex.assert_trees_all_equal_structs(g1, params)
    chex.assert_trees_all_close(g1, g0, atol=1e-6, rtol=1e-5)
    # every parameter receives gradient
    for path, g in jax.tree_util.tree_flatten_with_path(g1)[0]:
        if "pos" in jax.tree_util.keystr(path):
            continue  # rows beyond the batch length get none
        assert np.abs(np.asarray(g)).max() > 0, path


def test_adam_overfits_a_repeated_batch():
    model = GPT(GPTConfig(**TINY))
    params = model.init_params(0)
    batch = _batch(B=2, L=16, seed=11)
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: model.loss(LocalParams(p), batch))(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(60):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[0] > 5.0
    assert losses[-1] < 1.0, losses[::10]
