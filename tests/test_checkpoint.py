"""Checkpoints (qsdp_jax.checkpoint): exact resume, resharding 8 -> 4, refusals, atomicity."""

import numpy as np
import optax
import pytest

import jax
import qsdp_jax as q
import toymodel
from qsdp_jax import optim
from qsdp_jax.checkpoint import CheckpointMismatch, Checkpointer

SMALL = dict(bucket_size=64, min_shard_size=256)  # the 64x3 head stays replicated: every grid
# is whole buckets of its leaf's row-major order on 8, 4 and 2x4 devices (exact resharding)
K = 3
CONFIGS = {
    "fp32": q.QSDPConfig.fp32(**SMALL),
    "W8G8": q.QSDPConfig.qsdp(8, 8, **SMALL),
    "W4G4": q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", **SMALL),
    "W4G4-codes": q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", weight_storage="codes", **SMALL),
}


def _opt(config):
    return optim.qsdp(optax.chain(optim.clip_by_global_norm(1.0), optax.adam(1e-2)), config)


def _setup(config, n=8):
    mesh = q.make_mesh(devices=jax.devices()[:n])
    opt = _opt(config)
    state = q.init_train_state(toymodel.init(0), opt, mesh, config, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, config, donate=False)
    return mesh, state, step


def _bits(tree):
    return [
        np.asarray(x).view(np.uint32) if np.asarray(x).dtype == np.float32 else np.asarray(x)
        for x in jax.tree.leaves(tree)
    ]


def _assert_bitwise(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _global_opt(state, mesh):
    from qsdp_jax.checkpoint import export_state

    return {k: np.asarray(v) for k, v in export_state(state, mesh).items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_exact(name, tmp_path):
    """2k steps straight == k steps + save + restore into a fresh process state + k steps."""
    config = CONFIGS[name]
    mesh, state0, step = _setup(config)
    straight, losses = toymodel.run(step, state0, 0, 2 * K)
    half, first = toymodel.run(step, state0, 0, K)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        ckpt.save(half, config, mesh, extra={"data_position": K})
        ckpt.wait()
        fresh = q.init_train_state(toymodel.init(1), _opt(config), mesh, config, stacked=toymodel.STACKED)
        restored, extra = ckpt.restore(fresh, config, mesh)
    assert extra == {"data_position": K} and int(restored.step) == K
    _assert_bitwise(restored.params, half.params)
    _assert_bitwise(restored.opt_state, half.opt_state)
    resumed, second = toymodel.run(step, restored, K, 2 * K)
    assert first + second == losses
    _assert_bitwise(resumed.params, straight.params)
    _assert_bitwise(resumed.opt_state, straight.opt_state)


@pytest.mark.parametrize("name", ["fp32", "W4G4", "W4G4-codes"])
def test_reshard_8_to_4_and_back(name, tmp_path):
    """Saved on 8 devices, restored on 4: weights, grid and Adam moments bit for bit; saved
    again on 4 and restored on 8: the original state bit for bit. Training on 4 continues with
    the same losses up to summation order (fp32) or gradient-quantization noise (W4G4)."""
    config = CONFIGS[name]
    mesh8, state0, step8 = _setup(config, 8)
    half, _ = toymodel.run(step8, state0, 0, K)
    straight, losses = toymodel.run(step8, half, K, 2 * K)
    mesh4, fresh4, step4 = _setup(config, 4)
    with Checkpointer(tmp_path / "a", async_save=False) as ckpt:
        ckpt.save(half, config, mesh8)
        on4, _ = ckpt.restore(fresh4, config, mesh4)
    g8, g4 = _global_opt(half, mesh8), _global_opt(on4, mesh4)
    assert g8.keys() == g4.keys()
    for k in g8:
        np.testing.assert_array_equal(g8[k], g4[k], err_msg=k)
    _assert_bitwise(q.gather_params(on4), q.gather_params(half))
    with Checkpointer(tmp_path / "b", async_save=False) as ckpt:
        ckpt.save(on4, config, mesh4)
        back, _ = ckpt.restore(state0, config, mesh8)
    _assert_bitwise(back.params, half.params)
    _assert_bitwise(back.opt_state, half.opt_state)
    cont, losses4 = toymodel.run(step4, on4, K, 2 * K)
    if name == "fp32":  # same arithmetic, other summation order over devices
        np.testing.assert_allclose(losses4, losses, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(q.gather_params(cont)), jax.tree.leaves(q.gather_params(straight))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    else:  # other senders -> other gradient-quantization draws: close, not equal
        np.testing.assert_allclose(losses4, losses, rtol=0.05)


def test_zero_size_leaves_and_structure_are_stored(tmp_path):
    """fp32 mode holds zero-size grid placeholders (orbax refuses them): they round-trip."""
    config = CONFIGS["fp32"]
    mesh, state, _ = _setup(config)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state, config, mesh)
        meta = ckpt.metadata()
        restored, _ = ckpt.restore(state, config, mesh)
    assert any(shape == [0] for shape, _ in meta["leaves"].values())
    assert meta["config"]["weight_mode"] == "full" and meta["mesh_shape"] == {"fsdp": 8}
    assert meta["library_version"] == q.__version__ and meta["step"] == 0
    _assert_bitwise(restored.opt_state, state.opt_state)


@pytest.mark.parametrize(
    "other, field",
    [
        (q.QSDPConfig.qsdp(8, 4, weight_rounding="stochastic", **SMALL), "config.weight_bits"),
        (q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", seed=1, **SMALL), "config.seed"),
        (q.QSDPConfig.qsdp(4, 4, weight_rounding="shift", **SMALL), "config.weight_rounding"),
    ],
)
def test_restore_refuses_another_config(other, field, tmp_path):
    config = CONFIGS["W4G4"]
    mesh, state, _ = _setup(config)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state, config, mesh)
        _, fresh, _ = _setup(other)
        with pytest.raises(CheckpointMismatch, match=field.replace(".", r"\.")):
            ckpt.restore(fresh, other, mesh)


def test_restore_refuses_another_model_or_run(tmp_path):
    config = CONFIGS["W8G8"]
    mesh, state, _ = _setup(config)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state, config, mesh, identity={"lr": 0.01})
        params = toymodel.init(0)
        params["head"]["w"] = np.zeros((64, 5), np.float32)  # another output width
        wider = q.init_train_state(params, _opt(config), mesh, config, stacked=toymodel.STACKED)
        with pytest.raises(CheckpointMismatch, match="layout.groups.head.leaves"):
            ckpt.restore(wider, config, mesh, identity={"lr": 0.01})
        with pytest.raises(CheckpointMismatch, match=r"identity\.lr is 0\.01 in the checkpoint but 0\.02"):
            ckpt.restore(state, config, mesh, identity={"lr": 0.02})
        plain = q.init_train_state(
            toymodel.init(0), optim.qsdp(optax.adam(1e-2), config), mesh, config, stacked=toymodel.STACKED
        )
        with pytest.raises(CheckpointMismatch, match="another state structure"):
            ckpt.restore(plain, config, mesh, identity={"lr": 0.01})


def test_half_written_checkpoint_is_never_picked_up(tmp_path):
    """A step directory that was never finalized (the process died mid-save) is ignored, and the
    next manager removes it."""
    config = CONFIGS["W8G8"]
    mesh, state, step = _setup(config)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state, config, mesh)
    later, _ = toymodel.run(step, state, 0, 1)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(later, config, mesh)
    # make step 1 look half-written: orbax's temporary name, as during a save
    import shutil

    shutil.move(tmp_path / "1", tmp_path / "1.orbax-checkpoint-tmp-123")
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 0
        restored, _ = ckpt.restore(state, config, mesh)
    _assert_bitwise(restored.params, state.params)
    assert not (tmp_path / "1.orbax-checkpoint-tmp-123").exists()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        Checkpointer(tmp_path / "empty").restore(state, config, mesh)


def _setup_2d(axes, storage, **placement):
    config = q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", weight_storage=storage, **SMALL, **placement)
    mesh = q.make_mesh(axes)
    opt = _opt(config)
    state = q.init_train_state(toymodel.init(1), opt, mesh, config, stacked=toymodel.STACKED)
    return config, mesh, state, q.make_train_step(toymodel.loss, opt, mesh, config, donate=False)


@pytest.mark.parametrize("name", ["W4G4", "W4G4-codes"])
def test_reshard_onto_2d_meshes_and_back(name, tmp_path):
    """W4G4 saved on 8 devices (1-D) restores onto a hierarchical ("node", "local") 2x4 mesh and
    onto a hybrid ("replica", "fsdp") 2x4 mesh: weights, grid and Adam moments bit for bit (the
    stored form does not depend on the mesh; only the config's axis names differ). Training
    continues there with losses close to the 1-D run's (other gradient-quantization draws: the
    two-level reduction quantizes in other places); saved on 2x4 and restored on 8: the
    state bit for bit. Code-held weights alike (their codes are laid out like the grid)."""
    config = CONFIGS[name]
    mesh8, state0, step8 = _setup(config, 8)
    half, _ = toymodel.run(step8, state0, 0, K)
    _, losses = toymodel.run(step8, half, K, 2 * K)
    with Checkpointer(tmp_path / "a", async_save=False) as ckpt:
        ckpt.save(half, config, mesh8)
        for axes, placement in [
            ({"node": 2, "local": 4}, dict(axis_name="local", node_axis="node")),
            ({"replica": 2, "fsdp": 4}, dict(replica_axis="replica")),
        ]:
            cfg2, mesh2, fresh, step2 = _setup_2d(axes, config.weight_storage, **placement)
            on2, _ = ckpt.restore(fresh, cfg2, mesh2)
            g8, g2 = _global_opt(half, mesh8), _global_opt(on2, mesh2)
            assert g8.keys() == g2.keys()
            for k in g8:
                np.testing.assert_array_equal(g8[k], g2[k], err_msg=f"{axes}: {k}")
            _assert_bitwise(q.gather_params(on2), q.gather_params(half))
            cont, losses2 = toymodel.run(step2, on2, K, 2 * K)
            assert int(cont.step) == 2 * K
            np.testing.assert_allclose(losses2, losses, rtol=0.05, err_msg=str(axes))
            if "node" in axes:
                hier = (on2, cfg2, mesh2)
    with Checkpointer(tmp_path / "b", async_save=False) as ckpt:
        ckpt.save(*hier)
        back, _ = ckpt.restore(state0, config, mesh8)
    _assert_bitwise(back.params, half.params)
    _assert_bitwise(back.opt_state, half.opt_state)


def test_a_grid_of_other_buckets_is_refused_or_regridded(tmp_path):
    """The 64x3 head sharded (min_shard_size=128): its blocks are 24 elements on 8 devices and
    48 on 4, one padded bucket each, so its grid depends on the device count. Restoring on 4
    refuses, naming the leaf; regrid=True re-projects it (round to nearest, at most half a
    step) and the gather is lossless again; every other leaf restores bit for bit."""
    config = q.QSDPConfig.qsdp(4, 4, weight_rounding="stochastic", bucket_size=64, min_shard_size=128)
    mesh8, state8, step8 = _setup(config, 8)
    state8, _ = toymodel.run(step8, state8, 0, 2)
    mesh4, fresh, step4 = _setup(config, 4)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state8, config, mesh8)
        with pytest.raises(CheckpointMismatch, match=r"head/w.*regrid=True"):
            ckpt.restore(fresh, config, mesh4)
        with pytest.warns(UserWarning, match=r"\['head/w'\].*re-projected"):
            on4, _ = ckpt.restore(fresh, config, mesh4, regrid=True)
    old, new = np.asarray(state8.params["head"]["w"]), np.asarray(on4.params["head"]["w"])
    step_size = float(np.max(np.asarray(optim.find_qsdp_state(on4.opt_state).scales["head"]["w"])))
    assert 0 < np.abs(new - old).max() <= 0.5 * step_size + 1e-7
    _assert_bitwise(on4.params["blocks"], state8.params["blocks"])
    _assert_bitwise(on4.params["embed"], state8.params["embed"])
    with optim.layout_context(on4.layout, mesh4, config.shard_axes):  # on the new grid exactly
        snapped = jax.jit(lambda p, o: optim.snap_to_grid(p, o, config))(on4.params, on4.opt_state)
    _assert_bitwise(snapped, on4.params)
    cont, losses = toymodel.run(step4, on4, 2, 4)
    assert np.isfinite(losses).all()


def test_code_held_weights_of_other_buckets_are_refused(tmp_path):
    """Code-held weights are codes of the old mesh's grid: where a leaf's buckets differ on the
    new mesh (the 24-element head blocks of the test above) restore refuses, regrid=True too,
    naming the leaf and what to do."""
    config = q.QSDPConfig.qsdp(4, 4, bucket_size=64, min_shard_size=128, weight_storage="codes")
    mesh8, state8, step8 = _setup(config, 8)
    state8, _ = toymodel.run(step8, state8, 0, 1)
    mesh4, fresh, _ = _setup(config, 4)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(state8, config, mesh8)
        for regrid in (False, True):
            with pytest.raises(CheckpointMismatch, match=r"head/w"):
                ckpt.restore(fresh, config, mesh4, regrid=regrid)
        on8, _ = ckpt.restore(state8, config, mesh8)  # the same mesh restores exactly
    _assert_bitwise(on8.params, state8.params)
