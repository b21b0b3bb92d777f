"""Scheme names of the benchmarks: a ``QSDPConfig`` name with options, e.g. ``qsdp-W8G8+codes``.

``+codes`` holds QSDP's on-grid weights as their codes (``QSDPConfig(weight_storage="codes")``),
``+mu-bf16`` keeps adam's first moment in bfloat16 (``optax.adam(mu_dtype=jnp.bfloat16)``),
``+moments-bf16`` both moments, rounded stochastically (``qsdp_jax.optim.compact_moments``),
``+take`` reads the GPT's embeddings as rows (``GPTConfig(embed_lookup="take")``:
``ParamAccess.take``) instead of from the gathered table, ``+2level`` runs hierarchical QSDP on
a ``(node, local)`` mesh of the target's hosts (``QSDPConfig(node_axis="node", axis_name="local")``:
every collective in two stages, the inter-node one between one device per node).
"""

from __future__ import annotations

import dataclasses

OPTIONS = ("codes", "mu-bf16", "moments-bf16", "take", "2level")


def split_scheme(scheme: str) -> tuple[str, frozenset[str]]:
    """``"qsdp-W8G8+codes+mu-bf16"`` -> ``("qsdp-W8G8", {"codes", "mu-bf16"})``.

    Raises:
      ValueError: an unknown option, or ``+codes`` on a scheme that keeps no weight grid.
    """
    name, *options = scheme.split("+")
    for o in options:
        if o not in OPTIONS:
            raise ValueError(f"scheme {scheme!r}: unknown suffix {o!r}; known: {list(OPTIONS)}")
    if "codes" in options and not name.startswith("qsdp"):
        raise ValueError(f"scheme {scheme!r}: +codes needs a qsdp scheme (weights on a grid)")
    if "2level" in options and not name.startswith(("qsdp", "fp32")):
        raise ValueError(f"scheme {scheme!r}: +2level needs a qsdp_jax scheme (GSPMD chooses its own collectives)")
    if "mu-bf16" in options and "moments-bf16" in options:
        raise ValueError(f"scheme {scheme!r}: +moments-bf16 already holds the first moment in bfloat16")
    return name, frozenset(options)


def scheme_config(scheme: str):
    """The ``QSDPConfig`` of a (non-GSPMD) scheme, its options applied."""
    import qsdp_jax as q

    name, options = split_scheme(scheme)
    config = q.QSDPConfig.from_name(name)
    if "2level" in options:
        config = dataclasses.replace(config, node_axis="node", axis_name="local")
    return dataclasses.replace(config, weight_storage="codes") if "codes" in options else config


def mesh_axes(scheme: str, n_devices: int, hosts: int):
    """The mesh ``make_mesh`` gets for the scheme: ``{"node": hosts, "local": n / hosts}`` with
    ``+2level``, else the 1-D ``"fsdp"``."""
    if "2level" in split_scheme(scheme)[1]:
        return {"node": hosts, "local": n_devices // hosts}
    return "fsdp"


def embed_lookup(scheme: str) -> str:
    """The scheme's ``GPTConfig.embed_lookup``: ``"take"`` with ``+take``, else ``"gather"``."""
    return "take" if "take" in split_scheme(scheme)[1] else "gather"


def base_optimizer(scheme: str, learning_rate: float):
    """``optax.adam(learning_rate)`` with the scheme's moment option."""
    import jax.numpy as jnp
    import optax

    from qsdp_jax import optim

    _, options = split_scheme(scheme)
    adam = optax.adam(learning_rate, mu_dtype=jnp.bfloat16 if "mu-bf16" in options else None)
    return optim.compact_moments(adam) if "moments-bf16" in options else adam
