"""A small model with every kind of parameter group, for the train-step tests.

Groups: ``embed`` (a sharded matrix and a small replicated bias), ``blocks`` (layer-stacked:
a sharded matrix and a small replicated scale per layer), ``head`` (a 7x13-style odd matrix).
"""

import jax
import jax.numpy as jnp
import numpy as np

D, L, IN = 64, 3, 16
STACKED = ("blocks",)


def init(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "embed": {"w": jax.random.normal(k[0], (IN, D)) * 0.3, "b": jnp.zeros((D,))},
        "blocks": {"w": jax.random.normal(k[1], (L, D, D)) / np.sqrt(D), "s": jnp.ones((L, D))},
        "head": {"w": jax.random.normal(k[2], (D, 3)) / np.sqrt(D)},
    }


def loss(p, batch):
    e = p.gather("embed")
    x = batch["x"] @ e["w"] + e["b"]

    def body(c, lp, _):
        return c + jnp.tanh(c @ lp["w"]) * lp["s"], None

    x, _ = p.scan("blocks", body, x)
    y = x @ p.gather("head")["w"]
    return jnp.mean((y - batch["y"]) ** 2)


def loss_with_weights(p, batch):
    """Also returns the weights the devices computed with (one row per device via P(axis))."""
    e = p.gather("embed")
    x = batch["x"] @ e["w"] + e["b"]

    def body(c, lp, _):
        return c + jnp.tanh(c @ lp["w"]) * lp["s"], lp["w"]

    x, layer_ws = p.scan("blocks", body, x)
    head = p.gather("head")["w"]
    y = x @ head
    aux = {"embed": e["w"][None], "blocks": layer_ws[None], "head": head[None]}
    return jnp.mean((y - batch["y"]) ** 2), aux


def batch(seed=0, n=32):
    r = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(r.normal(size=(n, IN)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(n, 3)), jnp.float32),
    }


def run(step, state, start, stop):
    """Steps ``start .. stop - 1`` on ``batch(i)``: the final state and the losses as floats."""
    losses = []
    for i in range(start, stop):
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
    return state, losses
