"""Pallas kernels (interpret mode on CPU) against the jnp reference, bit for bit; the dispatch;
the train step with kernels on; lowering for TPU and CUDA; the device-check scripts."""

import functools
import os
import subprocess

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
import toymodel
from qsdp_jax import collectives as qc
from qsdp_jax import kernels as qk
from qsdp_jax.kernels import dispatch
from qsdp_jax import optim
from qsdp_jax._src.quant import quantizers as qz

JAX_MINOR = tuple(int(v) for v in jax.__version__.split(".")[:2])

T = "interpret"
N = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
    x.reshape(-1)[:8] = 1.5  # a constant run: a bucket of equal values somewhere is exact
    return jnp.asarray(x)


@functools.partial(jax.jit, static_argnames=("bits", "bucket", "rounding"))
def _ref_quantize(x, key, *, bits, bucket, rounding):
    """The reference as the train step runs it: jitted."""
    qt = qz.quantize(x, bits, bucket, rounding, key)
    return qz.pack_bits(qt.codes, bits), qt.scales, qt.offsets, qt.dequantize()


def _bucket_for(target, bucket):
    """The TPU form takes whole 128-lane rows: its buckets are the next multiple of 128."""
    return -(-bucket // 128) * 128 if target == "tpu_interpret" else bucket


@pytest.mark.parametrize("target", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_kernels_match_the_reference_bit_for_bit(bits, target):
    """quantize+pack for the three roundings and unpack+dequantize: equal to the reference for
    every bit width, buckets 64..4096, a bucket count (3 x 5 = 15) that is not a multiple of
    the row block on GPU/TPU; unpack+dequantize+sum for one width of each packing family
    (whole codes per byte, bit planes, bytes). (Each interpret-mode kernel costs an XLA compile
    of about a second here: the grid is chosen to keep the file near a minute and a half.)
    ``"tpu_interpret"`` is the TPU's own layout (``kernels._tpu``) in interpret mode."""
    T = target
    for r, rounding in enumerate(qz.ROUNDINGS):
        if rounding == "shift" and bits == 1:
            continue
        bucket = _bucket_for(T, BUCKETS[(bits + 2 * r) % len(BUCKETS)])
        x = _data((3, 5 * bucket), seed=10 * bits + r)
        key = qz.derive_key(7, bits, r)
        packed, scales, offsets, values = _ref_quantize(x, key, bits=bits, bucket=bucket, rounding=rounding)
        got = qk.quantize_pack(x, bits, bucket, rounding, key, target=T)
        chex.assert_trees_all_equal(got, (packed, scales, offsets))
    n = x.shape[-1]
    chex.assert_trees_all_equal(qk.unpack_dequantize(packed, scales, offsets, bits, bucket, n, target=T), values)
    if bits in (2, 5, 8):
        want = jax.jit(qc.sum_rows)(values)
        chex.assert_trees_all_equal(qk.unpack_dequantize_sum(packed, scales, offsets, bits, bucket, n, target=T), want)


def _one_call(x, target):
    return (
        qk.unpack_dequantize(
            jnp.zeros((8, 1024), jnp.uint8),
            jnp.ones((8, 1), jnp.float32),
            jnp.zeros((8, 1), jnp.float32),
            8,
            1024,
            1024,
            target=target,
        )
        + x
    )


def test_the_tpu_sum_over_many_senders_takes_smaller_blocks_and_the_same_bits():
    """The TPU sum's row block shrinks with the sender count so all senders' chunks fit one
    grid step's VMEM (16 senders x 64 buckets failed to compile on v5p): the same blocks up to
    8 senders, 32 buckets at 16, 8 at 64, whole 32-sublane tiles; past 128 senders not even its
    smallest block fits: the dispatch lowers the reference for TPU there, the kernel says so; in
    interpret mode the sum of 16 senders over several such blocks (and a partial one) is the
    reference's bit for bit."""
    from qsdp_jax.kernels import _tpu

    assert [_tpu.sum_row_block(1000, 1024, n, "mosaic_tpu") for n in (3, 8, 16, 64)] == [64, 64, 32, 8]
    assert _tpu.sum_row_block(1000, 128, 64, "mosaic_tpu") == 64 and _tpu.sum_row_block(5, 1024, 64, "mosaic_tpu") == 5
    assert _tpu.sum_fits(128, 1024) and not _tpu.sum_fits(256, 1024)
    for fits, calls in ((True, 1), (False, 0)):  # the dispatch lowers the reference for TPU where it does not fit
        lowered = jax.jit(
            lambda x, fits=fits: qk.select("pallas", lambda v: v + 1.0, _one_call, x, bucket=1024, tpu_fits=fits)
        )
        text = jax.export.export(lowered, platforms=["tpu"])(jax.ShapeDtypeStruct((8, 1024), jnp.float32)).mlir_module()
        assert text.count("tpu_custom_call") == calls, fits
    many = jnp.zeros((256, 1024), jnp.uint8), jnp.zeros((256, 1), jnp.float32)
    with pytest.raises(ValueError, match="cannot sum 256 senders.*kernels='reference'"):
        qk.unpack_dequantize_sum(many[0], many[1], many[1], 8, 1024, 1024, target="tpu_interpret")
    bits, bucket, senders = 8, 1024, 16
    x = _data((senders, 45 * bucket), seed=3)  # 45 buckets a sender: 32 + a partial block
    packed, scales, offsets, values = _ref_quantize(x, qz.derive_key(1), bits=bits, bucket=bucket, rounding="nearest")
    got = qk.unpack_dequantize_sum(packed, scales, offsets, bits, bucket, x.shape[-1], target="tpu_interpret")
    chex.assert_trees_all_equal(got, jax.jit(qc.sum_rows)(values))


@pytest.mark.parametrize("target", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("bits,rounding,bucket", [(2, "shift", 64), (5, "stochastic", 4096)])
def test_projection_snap_and_grid_pack_match_the_reference(bits, rounding, bucket, target):
    T, bucket = target, _bucket_for(target, bucket)
    x = _data((2, 3 * bucket), seed=bits)
    key = qz.derive_key(1, bits)
    packed, scales, offsets, values = _ref_quantize(x, key, bits=bits, bucket=bucket, rounding=rounding)
    chex.assert_trees_all_equal(qk.project(x, bits, bucket, rounding, key, target=T), (values, scales, offsets))
    chex.assert_trees_all_equal(qk.grid_pack(values, scales, offsets, bits, bucket, target=T), packed)
    moved = x + 0.01 * jnp.abs(x)
    want = jax.jit(lambda v: qz.quantize_on_grid(v, scales, offsets, bits, bucket).dequantize())(moved)
    chex.assert_trees_all_equal(qk.snap(moved, scales, offsets, bits, bucket, target=T), want)


def test_optimizer_projection_with_kernels_on_leaves_of_odd_length():
    """Single-device qsdp(): leaves of 4099 and 1000 elements (not multiples of the bucket or of
    8) are edge-padded to whole buckets; kernels and reference give the same updates and grid.
    """
    params = {"a": _data((4099,), 1), "b": _data((10, 100), 2), "c": jnp.ones((3,))}
    grads = jax.tree.map(lambda p: 0.1 * jnp.cos(p), params)
    out = {}
    for mode in ("reference", "interpret"):
        cfg = q.QSDPConfig.qsdp(4, 8, bucket_size=128, min_shard_size=100, kernels=mode)
        opt = optim.qsdp(optax.sgd(0.1), cfg)
        p, st = jax.jit(lambda p: optim.init_on_grid(p, opt, cfg))(params)  # noqa: B023  (run in this iteration)
        u, st = jax.jit(opt.update)(grads, st, p)
        step = jax.jit(lambda p, u, st: optim.apply_updates(p, u, st, cfg))  # noqa: B023  (run in this iteration)
        out[mode] = (step(p, u, st), st.scales, st.offsets)
    chex.assert_trees_all_equal(out["interpret"], out["reference"])


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh("fsdp")


def test_collectives_with_kernels_inside_shard_map(mesh, bits=3):
    """On 8 devices: the QSDP all-gather (grid), the ZeRO++-style gather and the quantized
    reduce-scatter give the reference's bits with the kernels in interpret mode. (Pallas's
    interpreter fails under ``check_vma=True``: "dynamic_slice requires varying manual axes
    to match"; the train step uses ``check_vma=False``.)"""
    bucket = 64
    x = _data((N * 3 * bucket,), 3)
    qt = jax.jit(lambda v: qz.quantize(v, bits, bucket, "nearest"))(x)
    on_grid = qt.dequantize()

    def run(mode):
        def f(w, s, o):
            a = qc.quantized_all_gather(w, bits=bits, bucket=bucket, axis_name="fsdp", grid=(s, o), kernels=mode)
            b = qc.quantized_all_gather(w, bits=bits, bucket=bucket, axis_name="fsdp", kernels=mode)
            c = qc.quantized_reduce_scatter(
                a + b, bits=bits, bucket=bucket, axis_name="fsdp", key=jnp.uint32(5), kernels=mode
            )
            return a, b, c

        spec = P("fsdp")
        fn = jax.shard_map(f, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec), check_vma=False)
        return jax.jit(fn)(on_grid, qt.scales, qt.offsets)

    got, want = run("interpret"), run("reference")
    for gathered in np.asarray(got[0]).reshape(N, -1):  # every device: lossless
        np.testing.assert_array_equal(gathered, on_grid)
    chex.assert_trees_all_equal(got, want)


def test_gradients_through_kernels_are_the_references():
    """Pallas has no autodiff: the dispatch puts each kernel under a custom_vjp with the
    reference's VJP, so ``jax.grad`` through a kernel gives the reference's gradient (here
    through the projection, whose values depend on each bucket's min and max). Through the
    collectives the payload is integer and the gradient is the custom_vjp of make_gather."""
    x = _data((2, 3 * 64), 4)
    key = qz.derive_key(9)

    def grad(mode):
        def f(v):
            def ref(a):
                qt = qz.quantize(a, 4, 64, "shift", key)
                return qt.dequantize(), qt.scales, qt.offsets

            values, scales, _ = qk.select(
                mode, ref, lambda a, target: qk.project(a, 4, 64, "shift", key, target=target), v, bucket=64
            )
            return jnp.sum(jnp.sin(values)) + jnp.sum(scales)

        return jax.jit(jax.grad(f))(x)

    want = grad("reference")
    assert float(jnp.abs(want).max()) > 0
    chex.assert_trees_all_equal(grad("interpret"), want)


CFG = dict(bucket_size=64, min_shard_size=128)


def _train(mesh, mode, steps, storage="float32"):
    cfg = q.QSDPConfig.qsdp(4, 4, kernels=mode, weight_storage=storage, **CFG)
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.init_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
    losses = []
    for i in range(steps):
        state, metrics = step(state, toymodel.batch(i))
        losses.append(float(metrics["loss"]))
    return losses, state.params


def test_train_step_with_kernels_repeats_the_reference(mesh):
    """Three QSDP W4G4 steps on 8 devices: identical losses and weights with kernels forced on."""
    got_losses, got_params = _train(mesh, "interpret", 3)
    want_losses, want_params = _train(mesh, "reference", 3)
    assert got_losses == want_losses
    chex.assert_trees_all_equal(got_params, want_params)


def test_code_held_weights_with_kernels_repeat_the_reference(mesh):
    """Code-held W4G4 (the optimizer's encode and decode through the kernels too): two steps
    with kernels forced on equal the reference and the float32-held run, codes bit for bit."""
    got_losses, got_codes = _train(mesh, "interpret", 2, "codes")
    want_losses, want_codes = _train(mesh, "reference", 2, "codes")
    held_losses, _ = _train(mesh, "reference", 2)
    assert got_losses == want_losses == held_losses
    chex.assert_trees_all_equal(got_codes, want_codes)


@pytest.mark.parametrize("rounding", ["shift", "stochastic"])
@pytest.mark.parametrize("platform,marker", [("tpu", "tpu_custom_call"), ("cuda", "__gpu$xla.gpu.triton")])
def test_train_step_with_kernels_lowers_for(mesh, platform, marker, rounding):
    """jax.export of the whole QSDP step for TPU / CUDA on this CPU machine: the kernels'
    custom calls are in the module (projection with either weight rounding, snap, or with
    code-held weights their decode and encode, quantize+pack, unpack(+sum))."""
    if platform == "cuda" and JAX_MINOR >= (0, 11):
        pytest.skip(
            "jax >= 0.11 lowers a Triton kernel only with a GPU's compute capability: a GPU, or an "
            "abstract mesh with an AbstractDevice, which shard_map over a concrete CPU mesh refuses"
        )
    codes = rounding == "stochastic"  # code-held 4-bit weights: their encode and decode too
    kw = dict(weight_bits=4, grad_bits=8, weight_storage="codes") if codes else dict(weight_bits=8, grad_bits=4)
    # 128-element buckets: whole 128-lane rows, which the TPU kernels take (64 uses the reference there)
    cfg = q.QSDPConfig.qsdp(**kw, kernels="pallas", weight_rounding=rounding, **{**CFG, "bucket_size": 128})
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toymodel.batch(0))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = jax.export.export(step, platforms=[platform], disabled_checks=checks)(state, batch)
    text = exp.mlir_module()
    names = [
        "quantize_pack_grid",
        "quantize_pack_stochastic",
        "unpack_dequantize_4b" if codes else "unpack_dequantize_8b",
        "unpack_dequantize_sum",
        f"project_{rounding}",
        *([] if codes else ["project_grid"]),  # the snap (code-held weights are encoded instead)
    ]
    assert text.count(marker) >= len(names)
    for name in names:
        assert f"qsdp_{name}" in text, name


def test_auto_mode_traces_no_kernel_on_cpu_or_gpu(mesh, monkeypatch):
    """On a CPU-only process ``"auto"`` is the reference: the step's jaxpr holds no pallas_call,
    while ``"pallas"`` carries the kernels (lowered only for GPU/TPU). In a GPU process too
    (why: the dispatch's docstring), in a TPU process the kernels (the backend faked: the
    dispatch reads ``jax.default_backend()`` while tracing)."""

    def jaxpr(mode):
        cfg = q.QSDPConfig.qsdp(8, 4, kernels=mode, **CFG)
        opt = optim.qsdp(optax.adam(1e-2), cfg)
        state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
        step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
        return str(step.trace(state, toymodel.batch(0)).jaxpr)

    assert "pallas_call" not in jaxpr("auto")
    assert "pallas_call" in jaxpr("pallas")
    for backend, kernels in (("gpu", False), ("tpu", True)):
        monkeypatch.setattr(dispatch.jax, "default_backend", lambda b=backend: b)
        assert ("pallas_call" in jaxpr("auto")) == kernels, backend


@pytest.mark.parametrize(
    "axes,level", [({"node": 2, "local": 4}, "node_axis"), ({"replica": 2, "fsdp": 4}, "replica_axis")]
)
def test_kernel_switch_reaches_the_two_level_collectives(axes, level):
    """``QSDPConfig.kernels`` is honoured on 2-D meshes too: ``"pallas"`` puts kernels in every
    stage's quantize/pack and unpack, ``"reference"`` none (traced only)."""
    outer, inner = axes
    mesh = q.make_mesh(axes)

    def jaxpr(mode):
        cfg = q.QSDPConfig.qsdp(8, 8, inter_grad_bits=4, kernels=mode, axis_name=inner, **{level: outer}, **CFG)
        opt = optim.qsdp(optax.adam(1e-2), cfg)
        state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
        step = q.make_train_step(toymodel.loss, opt, mesh, cfg)
        return str(step.trace(state, toymodel.batch(0)).jaxpr)

    assert "pallas_call" not in jaxpr("reference")
    got = jaxpr("pallas")
    for name in ("quantize_pack_grid", "quantize_pack_stochastic", "unpack_dequantize"):
        assert f"qsdp_{name}" in got, name


@pytest.mark.parametrize("script", ["gpu_scripts/device_check.sh", "tpu_scripts/device_check.sh"])
def test_device_check_scripts_parse_and_dry_run(script, tmp_path):
    path = os.path.join(ROOT, script)
    subprocess.run(["bash", "-n", path], check=True)
    out = subprocess.run(["bash", path, "--dry-run", str(tmp_path)], check=True, capture_output=True, text=True).stdout
    assert "pytest" in out and "bench.kernels" in out and "device_check kernels" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def _on_device(target):
    """Kernels compiled for the real device against the reference jitted on it."""
    rng = np.random.default_rng(0)
    for bits, rounding, bucket in [
        (8, "stochastic", 1024),
        (4, "shift", 256),
        (3, "nearest", 64 if target == "triton" else 128),  # the TPU kernels need whole 128-lane rows
        (1, "stochastic", 4096),
    ]:
        x = jnp.asarray(rng.normal(size=(4, 5 * bucket)).astype(np.float32))
        _on_device_case(target, x, bits, rounding, bucket)


def _on_device_case(target, x, bits, rounding, bucket):
    """One (bits, rounding, bucket) of :func:`_on_device` (its own function, so the jitted
    lambdas close over these arguments rather than the loop's variables)."""
    key = qz.derive_key(2, bits)
    packed, scales, offsets, values = _ref_quantize(x, key, bits=bits, bucket=bucket, rounding=rounding)
    got = jax.jit(lambda v: qk.quantize_pack(v, bits, bucket, rounding, key, target=target))(x)
    chex.assert_trees_all_equal(got, (packed, scales, offsets))
    deq = jax.jit(lambda p, s, o: qk.unpack_dequantize(p, s, o, bits, bucket, x.shape[-1], target=target))
    chex.assert_trees_all_equal(deq(packed, scales, offsets), values)
    total = jax.jit(lambda p, s, o: qk.unpack_dequantize_sum(p, s, o, bits, bucket, x.shape[-1], target=target))
    chex.assert_trees_all_equal(total(packed, scales, offsets), jax.jit(qc.sum_rows)(values))


@pytest.mark.gpu
def test_triton_kernels_on_the_gpu_match_the_reference():
    _on_device("triton")


@pytest.mark.tpu
def test_mosaic_kernels_on_the_tpu_match_the_reference():
    _on_device("mosaic_tpu")


def test_device_check_kernels_runs_here(tmp_path):
    """The device check's kernel comparison (``device_check kernels``), one width in interpret
    mode: every output equal, each case with 28 and 32 buckets, the JSON and summary written."""
    from experiments.bench import device_check

    out = device_check.check_kernels(tmp_path, bits_list=(3,))
    assert out["target"] == "interpret" and out["equal_device_ref"] == out["checks"] == 3 * 2 * 6
    assert {r["buckets"] for r in out["rows"]} == {28, 32}
    assert all(r["device_ref_equals_cpu_ref"] for r in out["rows"])
    assert "36/36 with whole row blocks" in device_check.table(tmp_path)


def test_the_tpu_form_refuses_a_bucket_that_is_not_whole_lanes():
    """The TPU kernels take buckets of whole 128-lane rows; asked for another, they say so (the
    dispatch never asks: such buckets use the reference on a TPU)."""
    x = jnp.zeros((2, 4 * 64), jnp.float32)
    with pytest.raises(ValueError, match="bucket=64 does not suit the TPU kernels"):
        qk.quantize_pack(x, 8, 64, "nearest", target="tpu_interpret")
    with pytest.raises(ValueError, match="multiple of 128"):
        qk.unpack_dequantize(
            jnp.zeros((2, 256), jnp.uint8), jnp.zeros((2, 4)), jnp.zeros((2, 4)), 8, 64, 256, target="mosaic_tpu"
        )
