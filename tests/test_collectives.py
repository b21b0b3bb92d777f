"""Quantized collectives inside shard_map against their exact full-precision counterparts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import qsdp_jax as q
from qsdp_jax import collectives as qc
from qsdp_jax._src.quant import quantizers as qz

N = 8
BUCKET = 64
AXIS = "fsdp"


@pytest.fixture(scope="module")
def mesh():
    return q.make_mesh(AXIS)


def _smap(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _weights(n=N * 4 * BUCKET, seed=0):
    x = np.random.default_rng(seed).normal(size=(n,)).astype(np.float32)
    x[: 2 * BUCKET] *= 50.0
    return jnp.asarray(x)


def test_payload_roundtrip():
    x = _weights(3 * BUCKET)
    for bits in (1, 3, 4, 8):
        qt = qz.quantize(x, bits, BUCKET, "stochastic", qz.derive_key(bits))
        for split in (False, True):
            payload = qc.to_payload(qt, split=split)
            assert payload.dtype == jnp.uint8
            assert payload.shape == (qc.payload_size(x.size, bits, BUCKET),)
            back = qc.from_payload(payload, x.size, bits, BUCKET)
            chex.assert_trees_all_equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("first", ["min", "max"])
def test_the_cpu_boundary_does_not_change_the_payload(first):
    """The boundary's predicate reads the first code (0 when it is its bucket's minimum); both
    of its branches pack alike, so the bytes are the same either way."""
    x = np.array(_weights(3 * BUCKET))
    x[0] = x[:BUCKET].min() - 1.0 if first == "min" else x[:BUCKET].max() + 1.0
    for bits in (2, 3, 4):
        qt = qz.quantize(jnp.asarray(x), bits, BUCKET, "nearest")
        assert (int(qt.codes[0]) == 0) == (first == "min")
        payload = qc.to_payload(qt, split=True)
        chex.assert_trees_all_equal(payload, qc.to_payload(qt, split=False))
        back = qc.from_payload(payload, x.size, bits, BUCKET)
        chex.assert_trees_all_equal(back.codes, qt.codes)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9])
def test_sum_rows_is_the_sum_over_the_leading_axis(n):
    x = jnp.asarray(np.random.default_rng(n).normal(size=(n, 5, 6)), jnp.float32)
    np.testing.assert_allclose(qc.sum_rows(x), np.asarray(x, np.float64).sum(0), rtol=1e-6, atol=1e-6)
    # integers: exact
    i = jnp.arange(n * 4, dtype=jnp.int32).reshape(n, 4)
    chex.assert_trees_all_equal(qc.sum_rows(i), jnp.sum(i, axis=0))


CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU-specific lowering")


@CPU_ONLY
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_payloads_get_fusion_boundaries_on_cpu(mesh, bits):
    """The boundaries keep the quantizer out of the packing loop (3x on CPU) and let the
    per-bucket loops end in bucketed shapes (qc.cpu_boundary): in the compiled reduce-scatter
    one around the send's packing and one around the receive, for every width; in the
    all-gather one around the receive, and one around the send for packed codes only (an
    8-bit send is one fused pass without it)."""
    f = _smap(
        mesh,
        lambda x: qc.quantized_reduce_scatter(x, bits=bits, bucket=BUCKET, axis_name=AXIS, key=jnp.uint32(1)),
        P(AXIS),
        P(AXIS),
    )
    hlo = f.lower(jax.ShapeDtypeStruct((N * N * BUCKET,), jnp.float32)).compile().as_text()
    assert hlo.count(" conditional(") == 2
    g = _smap(mesh, lambda x: qc.quantized_all_gather(x, bits=bits, bucket=BUCKET, axis_name=AXIS), P(AXIS), P())
    hlo = g.lower(jax.ShapeDtypeStruct((N * BUCKET,), jnp.float32)).compile().as_text()
    assert hlo.count(" conditional(") == (1 if bits == 8 else 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_collectives_type_check_under_shard_map_vma(mesh, bits):
    """The default shard_map (check_vma=True) accepts both collectives, boundary included."""

    def f(x):
        full = qc.quantized_all_gather(x, bits=bits, bucket=BUCKET, axis_name=AXIS)
        return qc.quantized_reduce_scatter(full, bits=bits, bucket=BUCKET, axis_name=AXIS, key=jnp.uint32(3))

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    x = _weights()
    got = np.asarray(fn(x))
    np.testing.assert_allclose(got, N * np.asarray(x), rtol=0.1, atol=N * 4 * float(jnp.max(jnp.abs(x))) / 2**bits)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_non_finite_gradients_stay_non_finite_through_the_reduce_scatter(mesh, bits):
    clean = np.stack([np.asarray(_weights(seed=60 + i)) for i in range(N)])
    chunk = clean.shape[1] // N
    full = clean.copy()
    full[3, 5] = np.nan  # sender 3 -> device 0, bucket 0
    full[5, 2 * chunk + BUCKET + 1] = np.inf  # sender 5 -> device 2, bucket 1
    got = np.asarray(_quantized_rs(mesh, jnp.asarray(full), bits, [7])[0]).reshape(N, -1, BUCKET)
    want = np.asarray(_quantized_rs(mesh, jnp.asarray(clean), bits, [7])[0]).reshape(N, -1, BUCKET)
    assert not np.isfinite(got[0, 0]).any() and not np.isfinite(got[2, 1]).any()
    # everything else arrives exactly as without the bad values: the same chunk of the same
    # senders (3 and 5 included), and every other device
    ok = np.ones(got.shape[:2], bool)
    ok[0, 0] = ok[2, 1] = False
    np.testing.assert_array_equal(got[ok], want[ok])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gather_on_grid_is_lossless_on_every_device(mesh, bits):
    """Invariant 2 at the collective level: shards on their grid gather bit for bit."""
    x = _weights()

    def f(shard):
        i = lax.axis_index(AXIS)
        qt = qz.quantize(shard, bits, BUCKET, "shift", qz.derive_key(5, i))
        on_grid = qt.dequantize()
        got = qc.quantized_all_gather(on_grid, bits=bits, bucket=BUCKET, axis_name=AXIS, grid=(qt.scales, qt.offsets))
        want = lax.all_gather(on_grid, AXIS, tiled=True)
        return got[None], want[None]

    got, want = _smap(mesh, f, P(AXIS), (P(AXIS), P(AXIS)))(x)
    assert got.shape == (N, x.size)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_comm_gather_error_within_nearest_bound(mesh, bits):
    x = _weights(seed=1)
    got = _smap(
        mesh,
        lambda s: qc.quantized_all_gather(s, bits=bits, bucket=BUCKET, axis_name=AXIS),
        P(AXIS),
        P(),
    )(x)
    xb = np.asarray(x).reshape(-1, BUCKET)
    step = np.repeat((xb.max(1) - xb.min(1)) / (2**bits - 1), BUCKET)
    err = np.abs(np.asarray(got) - np.asarray(x))
    assert np.all(err <= 0.5 * step * (1 + 2**-15) + 1e-5)


def test_fp_collectives_match_lax(mesh):
    x = _weights(seed=2)
    g = _smap(mesh, lambda s: qc.all_gather_fp(s, axis_name=AXIS), P(AXIS), P())(x)
    chex.assert_trees_all_equal(g, x)
    gb = _smap(mesh, lambda s: qc.all_gather_fp(s, axis_name=AXIS, dtype="bfloat16"), P(AXIS), P())(x)
    chex.assert_trees_all_equal(gb, x.astype(jnp.bfloat16).astype(jnp.float32))
    full = jnp.stack([_weights(seed=10 + i) for i in range(N)])  # one full buffer per device
    rs = _smap(mesh, lambda f: qc.reduce_scatter_fp(f[0], axis_name=AXIS), P(AXIS), P(AXIS))(full)
    np.testing.assert_allclose(np.asarray(rs), np.asarray(full.sum(0)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype, width", [(jnp.uint8, 12), (jnp.uint8, 7), (jnp.bfloat16, 5), (jnp.uint16, 6)])
def test_all_to_all_as_words_moves_the_same_bits(mesh, dtype, width):
    """TPU's all-to-all of 8/16-bit rows as uint32 words (:func:`all_to_all_words`), run here on
    CPU: the same bits as ``lax.all_to_all``, rows padded to whole words or not."""
    from qsdp_jax._src.collective.tpu_wire import _all_to_all_as_words

    if dtype == jnp.bfloat16:  # finite: XLA:CPU's own bf16 all-to-all canonicalises NaN bits
        x = jax.random.normal(jax.random.key(3), (N * N, 2, width)).astype(dtype)
    else:
        x = jax.random.bits(jax.random.key(3), (N * N, 2, width), jnp.uint16).astype(dtype)

    def run(fn):
        return _smap(mesh, lambda r: fn(r.reshape(N, 2, width)).reshape(N, 2, width), P(AXIS), P(AXIS))(x)

    want = run(lambda r: lax.all_to_all(r, AXIS, 0, 0, tiled=False))
    got = run(lambda r: _all_to_all_as_words(r, AXIS))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert not np.array_equal(np.asarray(want).view(np.uint8), np.asarray(x).view(np.uint8))  # it moved


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.float32])
@pytest.mark.parametrize("width, tiled", [(300, False), (300, True), (5, True), (1024, True)])
def test_all_gather_as_tpu_words_moves_the_same_bits(mesh, dtype, width, tiled):
    """TPU's all-gather with each device's part as uint32 words, a multiple of 128 of them
    (``tpu_wire.all_gather_rows``: XLA:TPU runs an unaligned one as an all-reduce, and no uint8
    one asynchronously), run here on CPU: the same result as ``lax.all_gather``."""
    from qsdp_jax._src.collective.tpu_wire import _as_words

    x = jax.random.bits(jax.random.key(4), (N * width,), jnp.uint32).astype(dtype)
    out = P() if tiled else P(None)

    def run(fn):
        return _smap(mesh, fn, P(AXIS), out)(x)

    want = run(lambda r: lax.all_gather(r, AXIS, axis=0, tiled=tiled))
    got = run(lambda r: _as_words(r, lambda v: lax.all_gather(v, AXIS, axis=0, tiled=False)))
    got = got.reshape(-1) if tiled else got
    chex.assert_trees_all_equal(got, want)
    assert want.shape == ((N * width,) if tiled else (N, width))


def _quantized_rs(mesh, full, bits, keys, rounding="stochastic"):
    def f(fb, key):
        return qc.quantized_reduce_scatter(
            fb[0], bits=bits, bucket=BUCKET, axis_name=AXIS, key=key[0], rounding=rounding
        )

    fn = _smap(mesh, f, (P(AXIS), P()), P(AXIS))
    return np.stack([np.asarray(fn(full, jnp.asarray([k], jnp.uint32))) for k in keys])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_reduce_scatter_single_draw_bound(mesh, bits):
    """Invariant 3: one draw errs by less than the sum of the senders' bucket steps."""
    full = jnp.stack([_weights(seed=20 + i) for i in range(N)])
    exact = np.asarray(full.sum(0))
    got = _quantized_rs(mesh, full, bits, [123])[0]
    fb = np.asarray(full).reshape(N, -1, BUCKET)
    steps = (fb.max(2) - fb.min(2)) / (2**bits - 1)  # (sender, bucket)
    bound = np.repeat(steps.sum(0), BUCKET) * (1 + 2**-15) + 1e-4
    assert np.all(np.abs(got - exact) <= bound)


def test_quantized_reduce_scatter_is_unbiased_at_rate_one_over_sqrt_keys(mesh):
    """Invariant 3: the mean over K keys approaches the exact sum like 1/sqrt(K)."""
    full = jnp.stack([_weights(N * 2 * BUCKET, seed=40 + i) for i in range(N)])
    exact = np.asarray(full.sum(0))
    draws = _quantized_rs(mesh, full, 2, range(256))
    err_16 = np.sqrt(np.mean((draws[:16].mean(0) - exact) ** 2))
    err_256 = np.sqrt(np.mean((draws.mean(0) - exact) ** 2))
    ratio = err_16 / err_256  # 4 for an unbiased estimator
    assert 2.5 < ratio < 6.5, ratio
    # A biased quantizer does not improve with more keys: the check can fail.
    near = _quantized_rs(mesh, full, 2, range(16), rounding="nearest")
    assert np.allclose(near[0], near[-1])


def test_senders_use_independent_keys(mesh):
    """The same full buffer on every device must not round the same way on every sender."""
    one = _weights(N * BUCKET, seed=50)
    full = jnp.stack([one] * N)
    got = _quantized_rs(mesh, full, 1, [9])[0]
    fb = np.asarray(one).reshape(-1, BUCKET)
    step = np.repeat(fb.max(1) - fb.min(1), BUCKET)
    # identical rounding on all senders would give N * (lo or lo + step): check intermediate sums
    k = (got - N * np.repeat(fb.min(1), BUCKET)) / step
    assert np.mean(np.abs(k - np.round(k / N) * N) > 0.5) > 0.3


@pytest.mark.parametrize(
    "config",
    [
        q.QSDPConfig.fp32(bucket_size=BUCKET),
        q.QSDPConfig.bf16(bucket_size=BUCKET),
        q.QSDPConfig(weight_mode="comm", weight_bits=8, grad_bits=8, bucket_size=BUCKET),
    ],
    ids=lambda c: c.name,
)
def test_gather_vjp_is_the_reduce_scatter(mesh, config):
    spec = qc.GatherSpec.from_config(config)
    gather = qc.make_gather(spec)
    x = _weights(seed=60)
    w = jnp.stack([_weights(seed=61 + i) for i in range(N)])  # per-device cotangent weights

    def f(shard, wd):
        key = jnp.uint32(3)
        return jax.grad(lambda s: jnp.sum(gather(s, None, key) * wd[0]))(shard)

    g = np.asarray(_smap(mesh, f, (P(AXIS), P(AXIS)), P(AXIS))(x, w))
    exact = np.asarray(w.sum(0))
    if config.grad_bits is None and config.fp_comm_dtype == "float32":
        np.testing.assert_allclose(g, exact, rtol=1e-5, atol=1e-4)
    else:
        scale = np.abs(np.asarray(w)).max() * N
        assert np.max(np.abs(g - exact)) < 0.05 * scale


def test_qsdp_gather_without_grid_is_an_error(mesh):
    spec = qc.GatherSpec.from_config(q.QSDPConfig(bucket_size=BUCKET))
    with pytest.raises(ValueError, match="grid"):
        _smap(mesh, lambda s: spec.gather(s, None), P(AXIS), P())(_weights())


def test_reduce_scatter_rejects_ragged_buffers(mesh):
    with pytest.raises(ValueError, match="whole buckets"):
        _smap(
            mesh,
            lambda f: qc.quantized_reduce_scatter(f, bits=4, bucket=BUCKET, axis_name=AXIS, key=jnp.uint32(0)),
            P(),
            P(AXIS),
        )(jnp.ones((N * BUCKET + 8,)))


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_gather_pieces_are_the_gathered_buffer_cut_and_their_vjp_the_reduce_scatter(mesh, bits):
    """make_gather_pieces against make_gather + split_flat (the reference): the same pieces bit
    for bit (comm mode, pieces of whole and partial buckets, a gap between them) and the same
    gradient; and make_coded_gather of the shard's own payload equals both."""
    from qsdp_jax._src.layout.packing import split_flat

    config = q.QSDPConfig(weight_mode="comm", weight_bits=bits, grad_bits=8, bucket_size=BUCKET)
    spec = qc.GatherSpec.from_config(config)
    chunk = 4 * BUCKET
    spans = ((0, BUCKET + 5), (2 * BUCKET, 2 * BUCKET))  # a partial bucket, a gap, a whole piece
    pieces_fn, full_fn = qc.make_gather_pieces(spec, spans, chunk), qc.make_gather(spec)
    coded_fn = qc.make_coded_gather(spec, spans, chunk)
    x = _weights(seed=70)
    w = [_weights(N * N * n, seed=71 + i).reshape(N * N, n) for i, n in enumerate((BUCKET + 5, 2 * BUCKET))]

    def f(shard, w0, w1):
        key = jnp.uint32(5)
        payload = qc.quantize_payload(shard, bits=bits, bucket=BUCKET)
        got = pieces_fn(shard, None, key)
        want = split_flat(full_fn(shard, None, key).reshape(N, chunk), spans)
        coded = coded_fn(jnp.zeros_like(shard), payload, key)
        loss = lambda ps: sum(jnp.sum(p * wd) for p, wd in zip(ps, (w0, w1)))  # noqa: E731
        g_got = jax.grad(lambda s: loss(pieces_fn(s, None, key)))(shard)
        g_want = jax.grad(lambda s: loss(split_flat(full_fn(s, None, key).reshape(N, chunk), spans)))(shard)
        g_coded = jax.grad(lambda a: loss(coded_fn(a, payload, key)))(jnp.zeros_like(shard))
        return [p[None] for p in got + want + coded], g_got, g_want, g_coded

    out_specs = ([P(AXIS)] * 6, P(AXIS), P(AXIS), P(AXIS))
    pieces, g_got, g_want, g_coded = _smap(mesh, f, (P(AXIS), P(AXIS), P(AXIS)), out_specs)(x, *w)
    for a, b, c in zip(pieces[:2], pieces[2:4], pieces[4:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(g_got), np.asarray(g_want))
    np.testing.assert_array_equal(np.asarray(g_coded), np.asarray(g_want))


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_unquantized_gather_pieces_gather_each_piece_alone(mesh, name):
    """An unquantized gather (``"full"`` weights) sends each piece in an all-gather of its own:
    the pieces and their gradient are those of the gathered buffer cut (bit for bit), and the
    compiled gathers carry the pieces' bytes, not the whole buffer's (no layer-sized float buffer
    to copy the leaves out of)."""
    import re

    from qsdp_jax._src.layout.packing import split_flat

    config = getattr(q.QSDPConfig, name)(bucket_size=BUCKET)
    spec = qc.GatherSpec.from_config(config)
    chunk = 4 * BUCKET
    spans = ((0, BUCKET + 5), (2 * BUCKET, 2 * BUCKET))  # a partial bucket, a gap, a whole piece
    pieces_fn, full_fn = qc.make_gather_pieces(spec, spans, chunk), qc.make_gather(spec)
    x = _weights(seed=80)
    w = [_weights(N * N * n, seed=81 + i).reshape(N * N, n) for i, n in enumerate((BUCKET + 5, 2 * BUCKET))]

    def pieces_only(shard):
        return [p[None] for p in pieces_fn(shard, None, jnp.uint32(5))]

    def f(shard, w0, w1):
        key = jnp.uint32(5)
        got = pieces_fn(shard, None, key)
        want = split_flat(full_fn(shard, None, key).reshape(N, chunk), spans)
        loss = lambda ps: sum(jnp.sum(p * wd) for p, wd in zip(ps, (w0, w1)))  # noqa: E731
        g_got = jax.grad(lambda s: loss(pieces_fn(s, None, key)))(shard)
        g_want = jax.grad(lambda s: loss(split_flat(full_fn(s, None, key).reshape(N, chunk), spans)))(shard)
        return [p[None] for p in got + want], g_got, g_want

    pieces, g_got, g_want = _smap(mesh, f, (P(AXIS),) * 3, ([P(AXIS)] * 4, P(AXIS), P(AXIS)))(x, *w)
    for a, b in zip(pieces[:2], pieces[2:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(g_got), np.asarray(g_want))
    hlo = _smap(mesh, pieces_only, P(AXIS), [P(AXIS)] * 2).lower(x).compile().as_text()
    dims = re.findall(r"= [a-z0-9]+\[([\d,]+)\]\{[^}]*\} all-gather\(", hlo)  # [552] or [8,69]
    gathered = sorted(int(np.prod([int(d) for d in m.split(",")])) for m in dims)
    assert gathered == [N * (BUCKET + 5), N * 2 * BUCKET], gathered
