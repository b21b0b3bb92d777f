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

``H x`` is computed by :func:`fwht`: a dense ``(n / block, block) @ H`` matmul (``O(n block)``)
for blocks up to 256, two (a Kronecker factorization) above; :func:`fwht_butterfly` is the
``O(n log block)`` alternative (``log2(block)`` stages of reshapes and adds). Measured on CPU (``experiments/bench_rotation.py``): the
matmul runs faster up to block 256 and compiles in a fraction of the time; the butterfly inside
a train step's scanned backward compiled for minutes on XLA:CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from qsdp_jax import quantizers as qz

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


DENSE_MAX_BLOCK = 256  # measured on CPU: the dense matmul is faster up to here (README)


def fwht(x: jax.Array, block: int) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform of every block of ``block`` elements of the last
    axis of ``x`` (float32): ``H x`` per block, ``H`` as :func:`hadamard_matrix`. Its own inverse
    (to float32 rounding). A dense ``(.., block) @ H`` matmul (full float32 precision) for
    blocks up to :data:`DENSE_MAX_BLOCK`; above, two such matmuls (``H`` is a Kronecker product
    of two smaller Hadamard matrices). :func:`fwht_butterfly` is the O(n log block) alternative."""
    check_block(block, x.shape[-1])
    hi = jax.lax.Precision.HIGHEST  # TPU/GPU would otherwise multiply float32 in bf16 / TF32
    if block <= DENSE_MAX_BLOCK:
        rows = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, block)
        return jnp.matmul(rows, jnp.asarray(hadamard_matrix(block)), precision=hi).reshape(x.shape)
    # Sylvester: H_(b1 b2) = H_b1 (x) H_b2 (Kronecker), index i = i1 * b2 + i2; H is symmetric
    b2 = DENSE_MAX_BLOCK
    b1 = block // b2
    rows = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, b1, b2)
    rows = jnp.matmul(rows, jnp.asarray(hadamard_matrix(b2)), precision=hi)
    rows = jnp.einsum("...ij,ik->...kj", rows, jnp.asarray(hadamard_matrix(b1)), precision=hi)
    return rows.reshape(x.shape)


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
    h = qz.mix32(qz.mix32(jnp.arange(words, dtype=jnp.uint32)[None, :] + keys[:, None] * jnp.uint32(qz._GOLDEN))
                 ^ keys[:, None])
    bits = (h[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    signs = jnp.float32(1.0) - jnp.float32(2.0) * bits.astype(jnp.float32)
    return signs.reshape(len(keys), words * 32)[:, :n]


def rotate(x: jax.Array, signs: jax.Array, block: int) -> jax.Array:
    """``H D x`` per block: ``x`` and ``signs`` of the same shape (..., n)."""
    return fwht(x.astype(jnp.float32) * signs, block)


def unrotate(y: jax.Array, signs: jax.Array, block: int) -> jax.Array:
    """``D H y`` per block: the exact inverse of :func:`rotate` (to float32 rounding)."""
    return fwht(y, block) * signs
