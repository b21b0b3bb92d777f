"""Blockwise randomized Hadamard rotation of gradient chunks (``QSDPConfig.grad_rotation``).

Before a device quantizes the chunk it sends to device ``i`` in the reduce-scatter, every block
of ``block`` consecutive elements is multiplied by ``H D``: ``D`` random +-1 signs, ``H`` the
orthonormal Walsh-Hadamard matrix of size ``block``. An outlier is spread over its block, so
the per-bucket min/max range, and with it the quantization step, shrinks.

The receiver sums the dequantized chunks of all senders and applies the inverse ``D H`` once
(``H`` is symmetric and orthonormal, ``D`` its own inverse): the rotation is linear, so
sum-then-unrotate equals unrotate-then-sum. That needs one ``D`` for all senders of a chunk:
the signs are a function of (step key, buffer, destination chunk, position), never of the
sender (:func:`chunk_signs`). Stochastic rounding in the rotated domain is unbiased, and so is
its exact linear inverse.

``H x`` is computed by :func:`fwht` as small dense Hadamard matrices applied along the axes of
a Kronecker factorization of the block; :func:`fwht_butterfly` is the textbook alternative
(``log2(block)`` stages of reshapes and adds). Measured on CPU (``experiments/bench_rotation.py``):
the butterfly inside a train step's scanned backward compiled for minutes on XLA:CPU, and one
dense ``(n / block, block) @ H`` matmul costs ``block`` multiply-adds per element.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from qsdp_jax._src.quant import quantizers as qz

PURPOSE_ROTATION = 0x0707  # folded into the reduce-scatter key: the signs' own stream


def check_block(block: int, n: int) -> None:
    """``block`` must be a power of 2 >= 2 dividing ``n``."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"rotation block={block!r} is invalid: must be a power of 2 >= 2")
    if n % block:
        raise ValueError(f"last axis of length {n} is not a multiple of the rotation block={block}")


def hadamard_matrix(block: int) -> np.ndarray:
    """The orthonormal (Sylvester) Walsh-Hadamard matrix of size ``block``, float32."""
    check_block(block, block)
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(block)).astype(np.float32)


FACTOR_MAX = 16  # Hadamard factors of at most 16: ~sum(factors) multiply-adds per element


def kron_factors(block: int) -> tuple[int, ...]:
    """``block`` as a product of powers of 2 of at most :data:`FACTOR_MAX`, as even as possible
    (64 -> (8, 8), 256 -> (16, 16), 1024 -> (16, 8, 8))."""
    k = block.bit_length() - 1
    parts = -(-k // (FACTOR_MAX.bit_length() - 1))
    sizes = [k // parts + (1 if i < k % parts else 0) for i in range(parts)]
    return tuple(1 << e for e in sizes)


def fwht(x: jax.Array, block: int) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform of every block of ``block`` elements of the last
    axis of ``x`` (float32): ``H x`` per block, ``H`` as :func:`hadamard_matrix`. Its own inverse
    (to float32 rounding).

    Sylvester's ``H`` is a Kronecker product, ``H_(a b) = H_a (x) H_b`` with index ``i = i_a b +
    i_b``: the block is viewed as a small tensor (:func:`kron_factors`) and each axis is
    multiplied by its small dense Hadamard matrix (full float32 precision), about
    ``sum(factors)`` multiply-adds per element (16 for block 64, against 64 for one dense
    matmul and the log2(block) memory passes of :func:`fwht_butterfly`). Measured on CPU: see
    docs/guides/low_bit.md."""
    check_block(block, x.shape[-1])
    hi = jax.lax.Precision.HIGHEST  # TPU/GPU would otherwise multiply float32 in bf16 / TF32
    factors = kron_factors(block)
    lead = x.shape[:-1]
    t = x.astype(jnp.float32).reshape(*lead, -1, *factors)
    k = len(factors)
    for a, f in enumerate(factors):  # contract axis a of the block with H_f (symmetric)
        t = jnp.moveaxis(
            jnp.tensordot(t, jnp.asarray(hadamard_matrix(f)), axes=([t.ndim - k + a], [0]), precision=hi),
            -1,
            t.ndim - k + a,
        )
    return t.reshape(x.shape)


def fwht_butterfly(x: jax.Array, block: int) -> jax.Array:
    """:func:`fwht` as ``log2(block)`` butterfly stages of reshapes and adds, O(n log block)."""
    n = x.shape[-1]
    check_block(block, n)
    lead = x.shape[:-1]
    y = x.astype(jnp.float32)
    h = 1
    while h < block:  # stage: pairs (a, b) at distance h -> (a + b, a - b)
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    return y.reshape(x.shape) * jnp.float32(1.0 / math.sqrt(block))


def chunk_signs(key: jax.Array, chunks: jax.Array, n: int) -> jax.Array:
    """+-1.0 float32 signs ``(len(chunks), n)``: row ``r`` for destination chunk ``chunks[r]``
    under ``key`` (the reduce-scatter's step/buffer key), one per position of the chunk.
    A pure function of (key, chunk, position): every sender draws the same ``D`` for a chunk."""
    rot_key = qz.derive_key(key, PURPOSE_ROTATION)
    keys = jax.vmap(lambda c: qz.derive_key(rot_key, c))(jnp.asarray(chunks, jnp.uint32))
    words = -(-n // 32)  # one 32-bit hash gives the signs of 32 consecutive positions
    h = qz.mix32(
        qz.mix32(jnp.arange(words, dtype=jnp.uint32)[None, :] + keys[:, None] * jnp.uint32(qz.GOLDEN)) ^ keys[:, None]
    )
    bits = (h[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    signs = jnp.float32(1.0) - jnp.float32(2.0) * bits.astype(jnp.float32)
    return signs.reshape(len(keys), words * 32)[:, :n]


def rotate(x: jax.Array, signs: jax.Array, block: int) -> jax.Array:
    """``H D x`` per block: ``x`` and ``signs`` of the same shape (..., n)."""
    return fwht(x.astype(jnp.float32) * signs, block)


def unrotate(y: jax.Array, signs: jax.Array, block: int) -> jax.Array:
    """``D H y`` per block: the exact inverse of :func:`rotate` (to float32 rounding)."""
    return fwht(y, block) * signs
