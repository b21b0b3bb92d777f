"""The NNX front door as a new Flax NNX user meets it: the module stays the user's between steps
(nothing of it is donated), train/eval modes are explicit, and misuse (an int nnx.Param, a
donated state, a state of another model or another mesh) is a clear error in NNX words."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qsdp_jax as q
from qsdp_jax import nnx as qnnx

CFG = q.QSDPConfig.fp32(bucket_size=64, min_shard_size=64)
V, L = 32, 4


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.att = nnx.MultiHeadAttention(2, d, use_bias=False, decode=False, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.att(x))


class TinyGPT(nnx.Module):
    """Embedding, a list of attention blocks with dropout, an untied head."""

    def __init__(self, rngs, d=16, out=V):
        self.emb = nnx.Embed(V, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])
        self.head = nnx.Linear(d, out, rngs=rngs)

    def __call__(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DenseBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.lin(x))


class StackedGPT(nnx.Module):
    """Embedding, dense blocks with dropout as one nnx.vmap stack (scanned with
    qsdp_jax.nnx.scan), an untied head."""

    def __init__(self, rngs, d=16):
        self.emb = nnx.Embed(V, d, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return DenseBlock(d, rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        @qnnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def trunk(x, block):
            return block(x)

        return self.head(trunk(self.emb(tokens), self.blocks))


def xent(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def _batch(i=0):
    k1, k2 = jax.random.split(jax.random.key(i))
    return {"x": jax.random.randint(k1, (8, L), 0, V), "y": jax.random.randint(k2, (8, L), 0, V)}


def _model(cls=TinyGPT, **kw):
    return cls(nnx.Rngs(0, dropout=1), **kw)


def _opt():
    return q.optim.qsdp(optax.sgd(0.1), CFG)


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _buffers(tree):
    return {
        s.data.unsafe_buffer_pointer()
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array)
        for s in x.addressable_shards
    }


def _fresh(state):
    return jax.tree.map(jnp.copy, state)  # for a donating step, keeping ``state``


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


@pytest.fixture(scope="module")
def tiny(mesh):
    """A TinyGPT in training mode, a clone made before its state, the state, its (donating)
    train step and its eval step, shared by the tests below (steps compile once)."""
    model = _model()
    clone = nnx.clone(model)  # shares the module's arrays
    opt = _opt()
    state = qnnx.init_state(model, opt, mesh, CFG)
    train = qnnx.make_train_step(model, xent, opt, mesh, CFG)
    return dict(
        model=model, clone=clone, opt=opt, state=state, train=train, eval=qnnx.make_eval_step(model, xent, mesh, CFG)
    )


def _stacked(mesh):
    model = _model(StackedGPT)
    clone = nnx.clone(model)
    opt = _opt()
    state = qnnx.init_state(model, opt, mesh, CFG)
    return dict(model=model, clone=clone, opt=opt, state=state, train=qnnx.make_train_step(model, xent, opt, mesh, CFG))


def _alive(module) -> bool:
    return not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(module)))


@pytest.mark.parametrize("style", ["list", "stacked"])
def test_the_module_stays_usable_between_steps(mesh, tiny, style):
    """init_state and the (donating) step leave the user's module and its clones alive: they
    keep the weights of the last update, and update makes the module hold no buffer of the
    state (the next step donates that state)."""
    t = tiny if style == "list" else _stacked(mesh)
    model, clone, step = t["model"], t["clone"], t["train"]
    assert not _buffers(t["state"]) & _buffers(nnx.state(model))  # the state owns what it holds
    before = _params(model)
    first = _fresh(t["state"]) if style == "list" else t["state"]  # the fixture's is shared
    state, _ = step(first, _batch(0))
    assert _alive(model) and _alive(clone)
    chex.assert_trees_all_equal(_params(model), before)
    qnnx.update(model, state)
    assert not _buffers(state) & _buffers(nnx.state(model))
    np.testing.assert_array_equal(model.head.kernel[...], q.gather_params(state)["head"]["kernel"])
    step(state, _batch(2))  # donates the state the module was updated from
    assert _alive(model) and _alive(clone)
    assert not np.array_equal(model.head.kernel[...], clone.head.kernel[...])
    if style == "list":  # the user's own evaluation, in training mode (RNG keys and counts)
        float(nnx.jit(xent)(model, _batch(1)))


def test_gather_params_survive_the_next_step(tiny):
    state = _fresh(tiny["state"])
    params = q.gather_params(state)
    host = jax.device_get(params)
    for i in range(2):
        state, _ = tiny["train"](state, _batch(i))
    chex.assert_trees_all_equal(jax.device_get(params), host)


def test_train_and_eval_modes_are_the_steps_not_the_modules(mesh, tiny):
    """The train step trains with dropout and the eval step evaluates without, whatever mode
    the module was in when they were built or is in now; a train step built from a module in
    eval mode says so; mode=None runs the module's attributes as they are (here: an eval step
    in training mode, with the train step's dropout masks)."""
    model, opt, state = tiny["model"], tiny["opt"], tiny["state"]
    b = _batch(3)
    model.eval()
    try:
        with pytest.warns(UserWarning, match=r"eval mode \(blocks/0/att deterministic=True.*and \d+ more"):
            built_in_eval = qnnx.make_train_step(model, xent, opt, mesh, CFG, donate=False)
    finally:
        model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning in train mode, nor for an eval step
        qnnx.make_train_step(model, xent, opt, mesh, CFG)
        qnnx.make_eval_step(model, xent, mesh, CFG)
        as_is = qnnx.make_eval_step(model, xent, mesh, CFG, mode=None)  # as the module is: train
    dropout = float(tiny["train"](_fresh(state), b)[1]["loss"])  # built in train mode
    assert float(built_in_eval(state, b)[1]["loss"]) == dropout
    deterministic = float(tiny["eval"](state, b))  # built in train mode
    assert abs(dropout - deterministic) > 1e-3
    assert float(as_is(state, b)) == pytest.approx(dropout, rel=1e-5)
    model.eval()  # toggling the module afterwards changes no step
    try:
        assert float(tiny["train"](_fresh(state), b)[1]["loss"]) == dropout
    finally:
        model.train()


class IntParam(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.table = nnx.Param(jnp.arange(8, dtype=jnp.int32))


class NaNParam(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.lin.bias[...] = jnp.full((8,), jnp.nan)


def test_bad_parameters_are_named_as_nnx_params(mesh):
    with pytest.raises(TypeError, match=r"nnx.Param table has dtype int32") as err:
        qnnx.init_state(IntParam(nnx.Rngs(0)), _opt(), mesh, CFG)
    assert "params dict" not in str(err.value) and "nnx.Variable" in str(err.value)
    with pytest.raises(ValueError, match=r"nnx.Param lin/bias holds NaN or Inf"):
        qnnx.init_state(NaNParam(nnx.Rngs(0)), _opt(), mesh, CFG)


def test_a_donated_state_is_a_clear_error(mesh, tiny):
    """Reusing a donated state used to segfault in the NNX step: now a RuntimeError, raised
    before the compiled step runs."""
    step, eval_step = tiny["train"], tiny["eval"]
    state = _fresh(tiny["state"])
    step(state, _batch(0))  # donates state
    for s in (step, eval_step):
        with pytest.raises(RuntimeError, match=r"the state's step was deleted: .*donated"):
            s(state, _batch(0))


def test_a_state_of_another_model_is_refused(mesh, tiny):
    """Same group names, other shapes: the step and update name the parameter and both shapes,
    and the module keeps its own."""
    model, step, eval_step = tiny["model"], tiny["train"], tiny["eval"]
    other = qnnx.init_state(_model(out=2 * V), tiny["opt"], mesh, CFG)
    msg = r"nnx.Param head/kernel is \(16, 64\) float32 in the state but \(16, 32\) float32 in the module"
    for s in (step, eval_step):
        with pytest.raises(ValueError, match=msg):
            s(other, _batch(0))
    with pytest.raises(ValueError, match=msg):
        qnnx.update(model, other)
    assert model.head.kernel.shape == (16, 32)


def test_a_state_on_another_mesh_is_refused(mesh, tiny):
    half = q.make_mesh(devices=jax.devices()[:4])
    state = qnnx.init_state(tiny["clone"], tiny["opt"], half, CFG)
    for step in (tiny["train"], tiny["eval"]):
        with pytest.raises(
            ValueError,
            match=r"state's step lies on the mesh \{'fsdp': 4\} \(4 devices.*"
            r"step was built for the mesh \{'fsdp': 8\} \(8 devices",
        ):
            step(state, _batch(0))


@pytest.mark.parametrize("style", ["list", "stacked"])
def test_a_loss_that_closes_over_the_module_is_refused(mesh, tiny, style):
    """``loss_fn`` computing with the module the step was built from (a closure) instead of the
    module it is given would train nothing, silently: the train and eval steps raise naming the
    parameter, and the module keeps its arrays (the same objects) and stays usable."""
    parts = tiny if style == "list" else _stacked(mesh)
    model = parts["model"]

    def closure(m, batch):
        return xent(model, batch)

    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    values = _params(model)
    train = qnnx.make_train_step(model, closure, parts["opt"], mesh, CFG)
    for step in (train, qnnx.make_eval_step(model, closure, mesh, CFG)):
        with pytest.raises(ValueError, match=r"parameter 'emb/embedding' of the module the step was built from"):
            step(_fresh(parts["state"]), _batch(0))
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(a is b for a, b in zip(before, after, strict=True))
    chex.assert_trees_all_equal(_params(model), values)
    model(_batch(0)["x"])  # it computes as before


def test_a_loss_may_close_over_a_clone_of_the_module(mesh, tiny):
    """A fixed copy (a teacher, an anchor) made with nnx.clone is another module: allowed."""
    teacher = nnx.clone(tiny["model"])
    teacher.eval()  # its dropout off: a closed-over module's RNG state cannot advance in a trace

    def distill(m, batch):
        return xent(m, batch) + jnp.mean((m(batch["x"]) - jax.lax.stop_gradient(teacher(batch["x"]))) ** 2)

    step = qnnx.make_train_step(tiny["model"], distill, tiny["opt"], mesh, CFG)
    _, metrics = step(_fresh(tiny["state"]), _batch(0))
    assert np.isfinite(float(metrics["loss"]))


def test_init_state_refuses_a_mesh_with_explicit_axes():
    """``jax.make_mesh((8,), ("fsdp",))`` (Explicit axes): refused at init_state naming the axis
    types and the one-line fix, not at the first step with a shard_map spec error."""
    model = TinyGPT(nnx.Rngs(0))
    opt = q.optim.qsdp(optax.adam(1e-3), CFG)
    with pytest.raises(ValueError, match=r"'fsdp': Explicit.*jax.make_mesh\(\.\.\., axis_types=\(AxisType.Auto,\)\)"):
        qnnx.init_state(model, opt, jax.make_mesh((8,), ("fsdp",)), CFG)


def test_abstract_state_for_a_memory_estimate_as_the_guide_shows():
    """The NNX guide's "bring your model" recipe: q.nnx.abstract_state (nothing allocated) of a
    concrete or an nnx.eval_shape module is init_state's state as sharded ShapeDtypeStructs;
    the step compiled for it holds what the step compiled for the real state holds.
    jax.eval_shape over init_state loses the shardings (the estimate would be of whole arrays)."""
    opt = q.optim.qsdp(optax.adam(1e-3), CFG)
    mesh = q.make_mesh()
    model = TinyGPT(nnx.Rngs(0))
    real = qnnx.init_state(model, opt, mesh, CFG)
    batch = {"tokens": jax.ShapeDtypeStruct((16, 8), jnp.int32), "targets": jax.ShapeDtypeStruct((16, 8), jnp.int32)}

    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["targets"]).mean()

    step = qnnx.make_train_step(model, loss_fn, opt, mesh, CFG)
    want = step.lower(real, batch).compile().memory_analysis()
    for source in (model, nnx.eval_shape(lambda: TinyGPT(nnx.Rngs(0)))):
        abstract = qnnx.abstract_state(source, opt, mesh, CFG)
        pairs = zip(jax.tree.leaves(abstract), jax.tree.leaves(real), strict=True)
        assert all((a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding) for a, r in pairs)
        got = step.lower(abstract, batch).compile().memory_analysis()
        assert (got.temp_size_in_bytes, got.argument_size_in_bytes) == (
            want.temp_size_in_bytes,
            want.argument_size_in_bytes,
        )
    lost = jax.eval_shape(lambda: qnnx.init_state(model, opt, mesh, CFG))
    assert jax.tree.leaves(lost.params)[0].sharding is None  # why the helper exists
