"""Code-held weights (QSDPConfig.weight_storage="codes"): the codes are the weights.

Every test compares against the float32-held twin of the same config: same losses and weights bit
for bit, on 1-D and 2-D meshes, with bit policies, the NNX front door and the eval step.
"""

import dataclasses

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax.comm import comm_report

SMALL = dict(bucket_size=64, min_shard_size=256)
MESHES = {
    "1d": ({"fsdp": 8}, {}),
    "node-local": ({"node": 2, "local": 4}, dict(axis_name="local", node_axis="node")),
    "replica-fsdp": ({"replica": 2, "fsdp": 4}, dict(replica_axis="replica")),
}


def _codes(config):
    return dataclasses.replace(config, weight_storage="codes")


def _opt(config):
    return optim.qsdp(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), config)


def _train(config, axes=None, steps=20, loss=toymodel.loss):
    mesh = q.make_mesh(axes) if axes else q.make_mesh()
    opt = _opt(config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(loss, opt, mesh, config)
    losses = []
    for i in range(steps):
        state, m = step(state, toymodel.batch(i))
        losses.append(float(m["loss"]))
    return state, losses, mesh


def _bits(tree):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


# both widths on the 1-D mesh, one on each 2-D mesh (the codes' layout is per width, the
# placement per mesh: the cross product repeats what these cover)
@pytest.mark.parametrize(
    "bits, mesh_name",
    [(8, "1d"), (4, "1d"), (8, "node-local"), (4, "replica-fsdp")],
    ids=["8-1d", "4-1d", "8-node-local", "4-replica-fsdp"],
)
def test_codes_train_bit_for_bit_like_float32_held_weights(bits, mesh_name):
    """20 steps of W8G8 / W4G4: the same losses and weights (decoded) bit for bit, and the
    optimizer state too; the code-held params are uint8 codes of the grid's layout."""
    axes, placement = MESHES[mesh_name]
    config = q.QSDPConfig.qsdp(bits, bits, **SMALL, **placement)
    if mesh_name == "1d":
        axes = None
    held, losses, _ = _train(config, axes)
    coded, coded_losses, _ = _train(_codes(config), axes)
    assert coded_losses == losses
    for a, b in zip(_bits(q.gather_params(coded)), _bits(q.gather_params(held)), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_bits(coded.opt_state), _bits(held.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    w = coded.params["blocks"]["w"]
    assert w.dtype == jnp.uint8 and w.shape == (toymodel.L, 8 * 64 * 8 * bits // 8)  # 8 buckets/device
    assert coded.params["blocks"]["s"].dtype == jnp.float32  # replicated: held as it is


def test_the_gather_sends_the_codes_and_is_lossless_on_every_device():
    """Every device computes with exactly the decoded weights, and the step's collectives move
    the same bytes as the float32-held step's."""
    config = _codes(q.QSDPConfig.qsdp(8, 8, **SMALL))
    state, _, mesh = _train(config, steps=3)
    opt = _opt(config)
    step = q.make_train_step(toymodel.loss_with_weights, opt, mesh, config, has_aux=True, donate=False)
    _, _, aux = step(state, toymodel.batch(0))
    want = q.gather_params(state)
    for name in ("embed", "blocks"):
        got = np.asarray(aux[name])
        for d in range(8):
            np.testing.assert_array_equal(got[d], np.asarray(want[name]["w"]), err_msg=f"{name} on device {d}")
    held = q.QSDPConfig.qsdp(8, 8, **SMALL)
    st_held, _, _ = _train(held, steps=1)
    a = comm_report(q.make_train_step(toymodel.loss, _opt(held), mesh, held), st_held, toymodel.batch(0))
    b = comm_report(q.make_train_step(toymodel.loss, opt, mesh, config), state, toymodel.batch(0))
    assert a.total_bytes == b.total_bytes and a.total_bytes > 0


def test_state_bytes_are_a_quarter_at_8_bits():
    config = q.QSDPConfig.qsdp(8, 8, **SMALL)
    held, _, _ = _train(config, steps=0)
    coded, _, _ = _train(_codes(config), steps=0)
    nbytes = lambda x: x.addressable_data(0).nbytes  # noqa: E731
    a, b = held.params["blocks"]["w"], coded.params["blocks"]["w"]
    assert nbytes(b) * 4 == nbytes(a)


def test_bit_policy_and_full_precision_leaves():
    """A policy puts the head at 4 bits and the embedding in full precision: the head is held
    as 4-bit codes, the embedding as float32, and training matches the float32-held twin."""
    policy = (("embed/*", None, 8), ("head/*", 4, 4))
    config = q.QSDPConfig.qsdp(8, 8, bucket_size=64, min_shard_size=128, bit_policy=policy)
    held, losses, _ = _train(config, steps=5)
    coded, coded_losses, _ = _train(_codes(config), steps=5)
    assert coded_losses == losses
    assert coded.params["embed"]["w"].dtype == jnp.float32 and coded.params["head"]["w"].dtype == jnp.uint8
    for a, b in zip(_bits(q.gather_params(coded)), _bits(q.gather_params(held)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_eval_and_abstract_state():
    config = _codes(q.QSDPConfig.qsdp(8, 8, **SMALL))
    state, _, mesh = _train(config, steps=2)
    held, _, _ = _train(q.QSDPConfig.qsdp(8, 8, **SMALL), steps=2)
    ev = lambda c, s: float(q.make_eval_step(toymodel.loss, mesh, c)(s, toymodel.batch(9)))  # noqa: E731
    assert ev(config, state) == ev(dataclasses.replace(config, weight_storage="float32"), held)
    abstract = q.abstract_train_state(toymodel.init(0), _opt(config), mesh, config, stacked=toymodel.STACKED)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.sharding.is_equivalent_to(b.sharding, len(a.shape))


def test_a_multisteps_micro_step_keeps_the_codes():
    config = _codes(q.QSDPConfig.qsdp(8, 8, **SMALL))
    mesh = q.make_mesh()
    opt = optim.qsdp(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, config, donate=False)
    after, _ = step(state, toymodel.batch(0))  # a micro-step: no update
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved, _ = step(after, toymodel.batch(1))
    assert not np.array_equal(np.asarray(moved.params["blocks"]["w"]), np.asarray(state.params["blocks"]["w"]))


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"weight_storage='codes' is invalid.*weight_mode='qsdp'"):
        q.QSDPConfig(weight_mode="comm", weight_storage="codes")
    with pytest.raises(ValueError, match=r"weight_storage='bf16' is invalid"):
        q.QSDPConfig.qsdp(8, 8, weight_storage="bf16")
    assert _codes(q.QSDPConfig.qsdp(8, 8)).name == "qsdp-sr-W8G8-codes"
    config = q.QSDPConfig.qsdp(8, 8, **SMALL)
    held, _, mesh = _train(config, steps=0)
    step = q.make_train_step(toymodel.loss, _opt(_codes(config)), mesh, _codes(config))
    with pytest.raises(ValueError, match=r"blocks/w.*weight_storage='float32'"):
        step(held, toymodel.batch(0))


def test_nnx_front_door():
    """An NNX model trains bit for bit alike held as codes or float32, and q.nnx.update
    writes the decoded weights into the module."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 64, rngs=rngs)
            self.b = nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    r = np.random.default_rng(0)
    batch = {"x": jnp.asarray(r.normal(size=(16, 16)), jnp.float32), "y": jnp.asarray(r.normal(size=(16, 8)))}
    out = []
    for config in (q.QSDPConfig.qsdp(8, 8, **SMALL), _codes(q.QSDPConfig.qsdp(8, 8, **SMALL))):
        model = MLP(nnx.Rngs(0))
        mesh = q.make_mesh()
        opt = optim.qsdp(optax.adam(1e-2), config)
        state = q.nnx.init_state(model, opt, mesh, config)
        step = q.nnx.make_train_step(model, loss_fn, opt, mesh, config)
        losses = []
        for _ in range(4):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        q.nnx.update(model, state)
        out.append((losses, np.asarray(model.a.kernel[...])))
    assert out[0][0] == out[1][0]
    np.testing.assert_array_equal(out[0][1], out[1][1])


def test_trainer_flags():
    """--weight-storage codes, --mu-dtype and --moments-dtype bfloat16 reach the run; codes with
    --fp32 (no grid) is a clear error; a default run's resume identity is what it was before
    any existed."""
    from experiments.gpt.args import CLIError, parse_args
    from experiments.gpt.run_files import RunCheckpoints
    from experiments.gpt.setup import build_run_config

    cfg, run = build_run_config(parse_args(["--weight-storage", "codes", "--mu-dtype", "bfloat16"]))
    assert cfg.weight_storage == "codes" and run.mu_dtype == "bfloat16"
    with pytest.raises(CLIError, match=r"weight_storage='codes' is invalid"):
        build_run_config(parse_args(["--fp32", "--weight-storage", "codes"]))
    _, default = build_run_config(parse_args([]))
    assert not {"mu_dtype", "moments_dtype"} & RunCheckpoints.identity(type("T", (), {"run": default})()).keys()
    assert RunCheckpoints.identity(type("T", (), {"run": run})())["mu_dtype"] == "bfloat16"
    _, both = build_run_config(parse_args(["--moments-dtype", "bfloat16"]))
    assert RunCheckpoints.identity(type("T", (), {"run": both})())["moments_dtype"] == "bfloat16"
    with pytest.raises(CLIError, match=r"moments_dtype='bfloat16' is invalid with mu_dtype='bfloat16'"):
        build_run_config(parse_args(["--moments-dtype", "bfloat16", "--mu-dtype", "bfloat16"]))


def test_checkpoints_of_float32_held_weights_made_before_the_field_still_restore(tmp_path):
    """A checkpoint record has ``weight_storage`` only when it is "codes": one made before the
    field existed (no key) restores into a float32-held state, and a code-held one is refused
    by a float32-held run naming the field."""
    from qsdp_jax._src.checkpoint.record import CheckpointMismatch, check_match, comparable, describe

    config = q.QSDPConfig.qsdp(8, 8, **SMALL)
    held, _, mesh = _train(config, steps=0)
    coded, _, _ = _train(_codes(config), steps=0)
    old = describe(held, config, mesh)
    assert "weight_storage" not in old["config"]
    check_match(comparable(old), comparable(describe(held, config, mesh)))
    with pytest.raises(CheckpointMismatch, match=r"config.weight_storage is 'codes' in the checkpoint but '<absent>'"):
        check_match(comparable(describe(coded, _codes(config), mesh)), comparable(old))
