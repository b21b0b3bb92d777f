"""No silent wrong results: each case the probe found is a clear error or correct behaviour."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import optim

SMALL = dict(bucket_size=64, min_shard_size=128)
CFG = q.QSDPConfig.qsdp(8, 8, **SMALL)


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh()


def _init(mesh, config, params=None, opt=None, **kw):
    opt = optim.qsdp(optax.adam(1e-2), config) if opt is None else opt
    params = toymodel.init(0) if params is None else params
    return q.init_train_state(params, opt, mesh, config, stacked=kw.pop("stacked", toymodel.STACKED), **kw), opt


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 1),
        ("weight_rounding", "shift"),
        ("weight_mode", "comm"),
        ("weight_bits", 4),
        ("grad_bits", 4),
        ("bucket_size", 128),
    ],
)
def test_optimizer_and_step_from_different_configs(mesh, field, value):
    import dataclasses

    other = dataclasses.replace(CFG, **{field: value})
    opt = optim.qsdp(optax.adam(1e-2), other)
    with pytest.raises(ValueError, match=rf"QSDPConfig\.{field}=.*(config has {field}=|same QSDPConfig)"):
        _init(mesh, CFG, opt=opt)


def test_optimizer_and_step_may_differ_in_kernels(mesh):
    """Every kernels mode computes the same bits, so a reference optimizer with an interpret-mode
    step trains exactly like the all-reference pair instead of being refused."""
    import dataclasses

    def run(step_kernels):
        opt = optim.qsdp(optax.adam(1e-2), dataclasses.replace(CFG, kernels="reference"))
        step_cfg = dataclasses.replace(CFG, kernels=step_kernels)
        state, _ = _init(mesh, step_cfg, opt=opt)
        step = q.make_train_step(toymodel.loss, opt, mesh, step_cfg)
        losses = []
        for i in range(2):
            state, m = step(state, toymodel.batch(i))
            losses.append(float(m["loss"]))
        return losses

    assert run("interpret") == run("reference")


def test_step_refuses_a_state_from_another_config(mesh):
    state, opt = _init(mesh, CFG)
    other = q.QSDPConfig.qsdp(8, 8, seed=3, **SMALL)
    step = q.make_train_step(toymodel.loss, opt, mesh, other)
    with pytest.raises(ValueError, match=r"QSDPConfig\.seed=0 but the train step's config has seed=3"):
        step(state, toymodel.batch(0))


@pytest.mark.parametrize("which", ["train", "eval"])
def test_step_refuses_a_state_on_another_mesh_naming_both(mesh, which):
    """A state made on 4 devices given to a step built for 8 raised JAX's "cannot reshape array
    of shape (8, 32) (size 256) into shape 512" from inside the step; now both meshes are named."""
    small = q.make_mesh(devices=jax.devices()[:4])
    state, opt = _init(small, CFG)
    make = q.make_train_step if which == "train" else q.make_eval_step
    step = make(toymodel.loss, opt, mesh, CFG) if which == "train" else make(toymodel.loss, mesh, CFG)
    with pytest.raises(
        ValueError, match=r"lies on the mesh \{'fsdp': 4\} .* but this step was built for the mesh \{'fsdp': 8\}"
    ):
        step(state, toymodel.batch(0))


def test_wrapped_twice(mesh):
    with pytest.raises(ValueError, match=r"wrapped with qsdp_jax.optim.qsdp\(\) twice"):
        _init(mesh, CFG, opt=optim.qsdp(optim.qsdp(optax.adam(1e-2), CFG), CFG))
    chained = optax.chain(optim.qsdp(optax.adam(1e-2), CFG), optim.qsdp(optax.sgd(1e-2), CFG))
    with pytest.raises(ValueError, match="more than one QSDPState"):
        _init(mesh, CFG, opt=chained)


def test_batch_leaves_of_different_sizes(mesh):
    state, opt = _init(mesh, CFG)
    step = q.make_train_step(toymodel.loss, opt, mesh, CFG)
    b = toymodel.batch(0)
    b["y"] = b["y"][:16]
    with pytest.raises(ValueError, match=r"different leading \(batch\) sizes \[16, 32\]"):
        step(state, b)


def test_overflow_into_the_weights_is_caught(mesh):
    """float16 replicated leaves near the top of their range: finite gradients, an update that
    overflows to Inf. The step reports it and keeps the old weights (it reported nonfinite=0
    and wrote Inf before)."""
    cfg = q.QSDPConfig.fp32(**SMALL)
    params = toymodel.init(0)
    params["embed"]["b"] = jnp.full((toymodel.D,), 65000.0, jnp.float16)
    state, opt = _init(mesh, cfg, params=params, opt=optim.qsdp(optax.sgd(1e6), cfg))
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg, donate=False)
    before = q.gather_params(state)
    new, metrics = step(state, toymodel.batch(0))
    assert int(metrics["nonfinite"]) == 1 and np.isfinite(float(metrics["loss"]))
    after = q.gather_params(new)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nan_in_params_at_init(mesh):
    params = toymodel.init(0)
    params["blocks"]["s"] = params["blocks"]["s"].at[1, 2].set(jnp.nan)
    with pytest.raises(ValueError, match=r"parameter \['blocks'\]\['s'\] holds NaN or Inf"):
        _init(mesh, CFG, params=params)


@pytest.mark.parametrize("value", [jnp.arange(4), jnp.array([True, False])])
def test_integer_and_bool_leaves(mesh, value):
    params = toymodel.init(0)
    params["head"]["ids"] = value
    with pytest.raises(TypeError, match=r"parameter \['head'\]\['ids'\] has dtype .*must be floating"):
        _init(mesh, CFG, params=params)


def test_zero_size_leaf_with_min_shard_size_zero(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=0)
    params = toymodel.init(0)
    params["head"]["empty"] = jnp.zeros((0, 3))
    state, opt = _init(mesh, cfg, params=params)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
    state, metrics = step(state, toymodel.batch(0))
    assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))
    assert q.gather_params(state)["head"]["empty"].shape == (0, 3)


def test_stacked_as_a_string(mesh):
    with pytest.raises(TypeError, match=r"stacked must be a sequence of group names, e.g. \('blocks',\)"):
        _init(mesh, CFG, stacked="blocks")


def test_donated_state_used_again(mesh):
    state, opt = _init(mesh, CFG)
    step = q.make_train_step(toymodel.loss, opt, mesh, CFG)  # donate=True
    step(state, toymodel.batch(0))
    with pytest.raises(RuntimeError, match="was donated to an earlier step call"):
        step(state, toymodel.batch(1))


def test_bucket_far_larger_than_the_leaves_warns(mesh):
    cfg = q.QSDPConfig.qsdp(8, 8, bucket_size=1 << 16, min_shard_size=128)
    with pytest.warns(UserWarning, match=r"bucket_size=65536 on 8 devices pads .*x the memory"):
        q.abstract_train_state(toymodel.init(0), optim.qsdp(optax.adam(1e-2), cfg), mesh, cfg, stacked=toymodel.STACKED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q.abstract_train_state(toymodel.init(0), optim.qsdp(optax.adam(1e-2), CFG), mesh, CFG, stacked=toymodel.STACKED)


def test_clip_by_global_norm_is_global(mesh):
    """optax.clip_by_global_norm used to see one device's shards in the sharded step; the
    optimizer now sees global arrays, so optax's own clip (and optim.clip_by_global_norm, its
    alias) matches one device on the global batch, and replicated leaves stay identical on
    every device."""
    assert optim.clip_by_global_norm is optax.clip_by_global_norm
    cfg = q.QSDPConfig.fp32(**SMALL)
    opt = optim.qsdp(optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), cfg)
    state, _ = _init(mesh, cfg, opt=opt)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
    ref_opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    params = toymodel.init(0)
    ref_state = ref_opt.init(params)
    for i in range(3):
        b = toymodel.batch(i)
        state, _ = step(state, b)
        g = jax.grad(lambda p: toymodel.loss(q.LocalParams(p), b))(params)  # noqa: B023  (run in this iteration)
        u, ref_state = ref_opt.update(g, ref_state, params)
        params = optax.apply_updates(params, u)
    for a, b in zip(jax.tree.leaves(q.gather_params(state)), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    x = state.params["blocks"]["s"]
    assert x.sharding.is_fully_replicated
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards)


@pytest.mark.parametrize("scale", [2.0, np.float64(2.0), np.full((3,), 2.0)], ids=["python", "np-scalar", "np-array"])
def test_python_and_float64_leaves_train_as_float32_like_optax(mesh, scale):
    """A Python float or NumPy float64 leaf: init_train_state accepted it and the first step
    raised "the state holds a/s as float32[] but ... holds it as float64[]"; now it is held and
    trained as the float32 JAX makes of it, as optax trains it on one device."""
    cfg = q.QSDPConfig.fp32(**SMALL)
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    params = toymodel.init(0)
    params["head"]["scale"] = scale
    state, _ = _init(mesh, cfg, params=params, opt=opt)
    assert state.params["head"]["scale"].dtype == jnp.float32

    def loss(p, b):
        return toymodel.loss(p, b) * jnp.mean(p.gather("head")["scale"])

    step = q.make_train_step(loss, opt, mesh, cfg)
    ref_params = jax.tree.map(jnp.asarray, params)
    ref_opt = optax.adam(1e-2)
    ref_state = ref_opt.init(ref_params)
    for i in range(3):
        b = toymodel.batch(i)
        state, _ = step(state, b)
        g = jax.grad(lambda p: loss(q.LocalParams(p), b))(ref_params)  # noqa: B023  (run in this iteration)
        u, ref_state = ref_opt.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    got = q.gather_params(state)["head"]["scale"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref_params["head"]["scale"]), rtol=1e-5)
    assert float(np.ravel(got)[0]) != 2.0  # it trained


@pytest.mark.parametrize("shape, names", [((8,), ("fsdp",)), ((2, 4), ("node", "fsdp"))])
def test_a_mesh_with_explicit_axes_is_refused_at_init_with_the_fix(shape, names):
    """``jax.make_mesh`` makes Explicit axes by default: init_train_state accepted such a mesh
    and the first step raised a shard_map spec error about an array the user never made."""
    mesh = jax.make_mesh(shape, names)
    cfg = CFG if len(names) == 1 else q.QSDPConfig.qsdp(8, 8, node_axis="node", **SMALL)
    fix = "(AxisType.Auto,)" if len(names) == 1 else "(AxisType.Auto,) * 2"
    with pytest.raises(ValueError, match=rf"not all Auto \('{names[0]}': Explicit.*axis_types={re.escape(fix)}"):
        _init(mesh, cfg)
    auto = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    state, opt = _init(auto, cfg)  # the one-line fix works
    step = q.make_train_step(toymodel.loss, opt, auto, cfg)
    _, metrics = step(state, toymodel.batch(0))
    assert np.isfinite(float(metrics["loss"]))
