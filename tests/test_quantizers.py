"""Reference quantizers: error bounds, unbiasedness, grids, packing, randomness."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qsdp_jax._src.quant import quantizers as qz

BUCKET = 64


def _data(n=4 * BUCKET, seed=0):
    x = np.random.default_rng(seed).normal(size=(n,)).astype(np.float32)
    x[:BUCKET] *= 100.0  # buckets with very different ranges
    return jnp.asarray(x)


def _bucket_range(x):
    xb = np.asarray(x).reshape(-1, BUCKET)
    return np.repeat(xb.max(1) - xb.min(1), BUCKET)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("rounding", ["stochastic", "nearest", "shift"])
def test_error_bound(bits, rounding):
    if rounding == "shift" and bits == 1:
        pytest.skip("shift needs bits >= 2 (tested below)")
    x = _data()
    qt = qz.quantize(x, bits, BUCKET, rounding, key=qz.derive_key(7, 1))
    y = np.asarray(qt.dequantize())
    err = np.abs(y - np.asarray(x))
    intervals = (2**bits - 2) if rounding == "shift" else (2**bits - 1)
    step = _bucket_range(x) / intervals
    factor = 1.0 if rounding == "stochastic" else 0.5
    # scales are rounded up to 16 significant bits, plus float32 rounding of the result
    bound = factor * step * (1 + 2**-15) + 1e-6 * np.abs(np.asarray(x)) + 1e-6
    assert np.all(err <= bound), (err / bound).max()
    assert int(qt.codes.max()) <= 2**bits - 1
    # error_bound agrees per bucket
    eb = np.repeat(np.asarray(qz.error_bound(qt, rounding)), BUCKET)
    assert np.all(err <= eb + 1e-6 * np.abs(np.asarray(x)) + 1e-6)


@pytest.mark.parametrize("bits", range(1, 9))
def test_stochastic_is_unbiased(bits):
    x = _data(2 * BUCKET, seed=1)
    draws = jax.vmap(lambda k: qz.quantize(x, bits, BUCKET, "stochastic", k).dequantize())(
        qz.mix32(jnp.arange(4000, dtype=jnp.uint32))
    )
    mean = np.asarray(draws.mean(0))
    step = _bucket_range(x) / (2**bits - 1)
    # std of one draw <= step/2; mean of 4000 draws: 5 sigma = 5 * step / (2 * sqrt(4000))
    assert np.all(np.abs(mean - np.asarray(x)) <= 5 * step / (2 * np.sqrt(4000)) + 1e-5)


@pytest.mark.parametrize("bits", range(2, 9))
def test_shift_is_unbiased_over_shifts(bits):
    x = _data(2 * BUCKET, seed=2)
    draws = jax.vmap(lambda k: qz.quantize(x, bits, BUCKET, "shift", k).dequantize())(
        qz.mix32(jnp.arange(4000, dtype=jnp.uint32))
    )
    mean = np.asarray(draws.mean(0))
    step = _bucket_range(x) / (2**bits - 2)
    assert np.all(np.abs(mean - np.asarray(x)) <= 5 * step / (2 * np.sqrt(4000)) + 1e-5)


def test_nearest_is_deterministic_and_biased_the_same_way():
    x = _data()
    a = qz.quantize(x, 3, BUCKET, "nearest").dequantize()
    b = qz.quantize(x, 3, BUCKET, "nearest").dequantize()
    chex.assert_trees_all_equal(a, b)


def test_shift_needs_two_bits_and_keys_are_required():
    with pytest.raises(ValueError, match="bits >= 2"):
        qz.quantize(_data(), 1, BUCKET, "shift", key=qz.derive_key(0))
    with pytest.raises(ValueError, match="needs a key"):
        qz.quantize(_data(), 4, BUCKET, "stochastic")
    with pytest.raises(ValueError, match="rounding"):
        qz.quantize(_data(), 4, BUCKET, "floor")
    with pytest.raises(ValueError, match="bits"):
        qz.quantize(_data(), 9, BUCKET, "nearest")
    with pytest.raises(ValueError, match="multiple of bucket"):
        qz.quantize(jnp.ones(BUCKET + 1), 4, BUCKET, "nearest")


def test_constant_bucket_is_exact():
    x = jnp.full((BUCKET,), 3.25, jnp.float32)
    for rounding in ("stochastic", "nearest", "shift"):
        qt = qz.quantize(x, 4, BUCKET, rounding, key=qz.derive_key(1))
        chex.assert_trees_all_equal(qt.dequantize(), x)
        assert float(qt.scales[0]) == 0.0
        assert int(qt.codes.max()) == 0
    # on a zero-scale grid every value maps to code 0 (the grid has one point)
    on = qz.quantize_on_grid(x + 1.0, qt.scales, qt.offsets, 4, BUCKET)
    assert int(on.codes.max()) == 0


def test_grid_roundtrip_is_bit_exact():
    """Values produced by a grid recover their codes exactly (the lossless gather's basis)."""
    x = _data(16 * BUCKET, seed=3) * 1e-3 + 5.0  # large offset relative to the range
    for bits in range(2, 9):
        qt = qz.quantize(x, bits, BUCKET, "shift", key=qz.derive_key(3, bits))
        y = qt.dequantize()
        again = qz.quantize_on_grid(y, qt.scales, qt.offsets, bits, BUCKET)
        chex.assert_trees_all_equal(again.codes, qt.codes)
        chex.assert_trees_all_equal(again.dequantize(), y)


def test_scales_have_16_significant_bits():
    s = qz.round_scale_up(jnp.asarray([0.1, 1e-30, 3.0, 0.0], jnp.float32))
    bits = np.asarray(s).view(np.uint32)
    assert np.all(bits & 0xFF == 0)
    assert np.all(np.asarray(s)[:3] >= np.asarray([0.1, 1e-30, 3.0], np.float32))
    assert float(s[3]) == 0.0


def test_bucket_ids_make_quantization_position_independent():
    """Quantizing half of a buffer with its global bucket ids equals that half of the whole."""
    x = _data(8 * BUCKET, seed=4)
    key = qz.derive_key(11)
    whole = qz.quantize(x, 4, BUCKET, "stochastic", key)
    ids = jnp.arange(4, 8, dtype=jnp.uint32)
    half = qz.quantize(x[4 * BUCKET :], 4, BUCKET, "stochastic", key, bucket_ids=ids)
    chex.assert_trees_all_equal(half.codes, whole.codes[4 * BUCKET :])


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 1001])
def test_pack_roundtrip(bits, n):
    codes = jnp.asarray(np.random.default_rng(n + bits).integers(0, 2**bits, size=(3, n)), jnp.uint8)
    packed = qz.pack_bits(codes, bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (3, n if bits == 8 else -(-n // 8) * bits)
    chex.assert_trees_all_equal(qz.unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_groups_is_unpack_bits_by_group(bits):
    """The receive's grouped unpacking flattens to unpack_bits, for leading axes of any rank;
    bit-plane widths refuse bytes that are not whole groups."""
    codes = jnp.asarray(np.random.default_rng(bits).integers(0, 2**bits, size=(2, 3, 40)), jnp.uint8)
    packed = qz.pack_bits(codes, bits)
    groups = qz.unpack_groups(packed, bits)
    per = 8 // bits if 8 % bits == 0 else 8
    assert groups.shape == (2, 3, 40 // per, per)
    chex.assert_trees_all_equal(groups.reshape(2, 3, 40), codes)
    if 8 % bits:
        with pytest.raises(ValueError, match="whole groups"):
            qz.unpack_groups(packed[..., 1:], bits)


def _pack_reference(codes: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, bit by bit in numpy (see the quantizers module docstring)."""
    if bits == 8:
        return codes.astype(np.uint8)
    n = codes.shape[-1]
    c = np.zeros(codes.shape[:-1] + (-(-n // 8) * 8,), np.uint8)
    c[..., :n] = codes
    groups = c.reshape(*c.shape[:-1], -1, 8).astype(np.int64)
    out = np.zeros(groups.shape[:-1] + (bits,), np.int64)
    for k in range(8):  # code k of a group
        for j in range(bits):  # bit j of that code
            bit = (groups[..., k] >> j) & 1
            if 8 % bits == 0:  # whole codes: code k in byte k*bits//8 at bits [(k*bits)%8, ...)
                pos = k * bits + j
            else:  # bit planes: byte j holds bit j of code k at bit k
                pos = j * 8 + k
            out[..., pos // 8] |= bit << (pos % 8)
    return out.reshape(*codes.shape[:-1], -1).astype(np.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_layout_matches_the_bitwise_reference(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(2, 3, 37)).astype(np.uint8)
    got = np.asarray(qz.pack_bits(jnp.asarray(codes), bits))
    np.testing.assert_array_equal(got, _pack_reference(codes, bits))


def test_bucket_range_is_min_and_max_and_propagates_nan():
    x = _data()
    xb = x.reshape(-1, BUCKET)
    lo, hi = qz.bucket_range(xb)
    chex.assert_trees_all_equal((lo, hi), (jnp.min(xb, -1), jnp.max(xb, -1)))
    xb = xb.at[1, 5].set(jnp.nan).at[2, 0].set(jnp.inf)
    lo, hi = qz.bucket_range(xb)
    assert np.isnan(lo[1]) and np.isnan(hi[1]) and hi[2] == np.inf
    assert np.isfinite(lo[0]) and np.isfinite(hi[3])


def test_pack_size_is_exact_and_layout_is_bit_planes():
    codes = jnp.asarray([1, 0, 1, 1, 0, 0, 0, 1], jnp.uint8)
    # 1 bit: code k at bit k
    assert int(qz.pack_bits(codes, 1)[0]) == 0b10001101
    assert np.asarray(qz.pack_bits(jnp.asarray([1, 2, 3, 0, 15, 9], jnp.uint8), 4)).tolist() == [
        0x21,
        0x03,
        0x9F,
        0x00,
    ]  # whole nibbles, low nibble first; 8-code groups, zero tail
    codes3 = jnp.arange(8, dtype=jnp.uint8)
    p = np.asarray(qz.pack_bits(codes3, 3))
    assert p.tolist() == [0b10101010, 0b11001100, 0b11110000]
    with pytest.raises(ValueError, match="does not match"):
        qz.unpack_bits(jnp.zeros((5,), jnp.uint8), 3, 16)


def test_hash_uniform_is_uniform_and_keyed():
    u = np.asarray(qz.hash_uniform(qz.derive_key(0), jnp.arange(200_000, dtype=jnp.uint32)))
    assert u.min() >= 0.0 and u.max() < 1.0
    hist, _ = np.histogram(u, bins=20, range=(0, 1))
    assert np.all(np.abs(hist / len(u) - 0.05) < 0.003)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    v = np.asarray(qz.hash_uniform(qz.derive_key(1), jnp.arange(200_000, dtype=jnp.uint32)))
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01
    # a pure function of its inputs
    assert int(qz.derive_key(3, 4, 5)) == int(qz.derive_key(3, 4, 5)) != int(qz.derive_key(3, 5, 4))


def test_qtensor_is_a_pytree():
    qt = qz.quantize(_data(), 4, BUCKET, "nearest")
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.bits == 4 and back.bucket == BUCKET
    chex.assert_trees_all_equal(jax.jit(lambda q: q.dequantize())(qt), qt.dequantize())


def test_hash_uniform_rows_is_hash_uniform_of_the_spread_counters():
    """The key-first spreading (no key-free full-size counters for XLA to hoist out of a layer
    loop) draws the same bits as hashing the element counters."""
    ids = jnp.arange(37, dtype=jnp.uint32).reshape(1, 37) * jnp.uint32(3) + jnp.uint32(0xFFFFFF00)
    for key in (jnp.uint32(0), qz.derive_key(7, 2, 5), jnp.uint32(0xFFFFFFFF)):
        want = qz.hash_uniform(key, ids[..., None] * jnp.uint32(64) + jnp.arange(64, dtype=jnp.uint32))
        got = qz.hash_uniform_rows(key, ids, 64)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
