"""The short names of :class:`qsdp_jax.config.QSDPConfig` (``qsdp-W8G8``, ``comm-W4GF32-rot64``):
reading a name into config fields and writing a config's name.

A name states the mode, the bits and, in ``"qsdp"`` mode, the weight rounding (``qsdp-`` the
paper's shift, ``qsdp-sr-`` stochastic rounding); suffixes name the outer level's bits, the
levers and a bit policy's bits. Names label tables and output directories.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"(?:(qsdp-sr|qsdp|comm|full)-)?W([1-8]|F32|BF16)G([1-8]|F32|BF16)")


def fields_from_name(name: str) -> dict:
    """The config fields a ``<mode>-W<bits>G<bits>`` name sets (``fp32`` / ``bf16`` are the
    config's own constructors, not read here).

    Raises:
      ValueError: an unknown name, or one mixing ``F32`` and ``BF16``.
    """
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(
            f"unknown config name {name!r}: use fp32, bf16 or <mode>-W<bits>G<bits> with mode "
            "qsdp, qsdp-sr, comm or full and bits 1..8, F32 or BF16 (e.g. qsdp-W8G8, comm-W4G4)"
        )
    mode, w, g = m.group(1) or "qsdp", m.group(2), m.group(3)
    fp = {x for x in (w, g) if not x.isdigit()}
    if len(fp) > 1:
        raise ValueError(f"config name {name!r} mixes F32 and BF16")
    fields = dict(
        weight_mode="qsdp" if mode == "qsdp-sr" else mode,
        weight_bits=int(w) if w.isdigit() else None,
        grad_bits=int(g) if g.isdigit() else None,
        fp_comm_dtype="bfloat16" if fp == {"BF16"} else "float32",
    )
    if mode in ("qsdp", "qsdp-sr"):  # the name says the rounding: qsdp- is the paper's shift
        fields["weight_rounding"] = "stochastic" if mode == "qsdp-sr" else "shift"
    return fields


def config_name(c) -> str:
    """``c``'s name (see :attr:`qsdp_jax.config.QSDPConfig.name`)."""
    if c.weight_bits is None and c.grad_bits is None:
        return ("fp32" if c.fp_comm_dtype == "float32" else "bf16") + _level_suffix(c) + _policy_suffix(c)
    fp = "F32" if c.fp_comm_dtype == "float32" else "BF16"
    w = f"W{c.weight_bits}" if c.weight_bits is not None else f"W{fp}"
    g = f"G{c.grad_bits}" if c.grad_bits is not None else f"G{fp}"
    mode = "qsdp-sr" if c.weight_mode == "qsdp" and c.weight_rounding == "stochastic" else c.weight_mode
    return f"{mode}-{w}{g}{_level_suffix(c)}{_lever_suffix(c)}{_policy_suffix(c)}"


def _lever_suffix(c) -> str:
    """``-rot64`` / ``-bf16stats`` / ``-codes`` when those switches are on (empty when off)."""
    out = f"-rot{c.grad_rotation}" if c.grad_rotation is not None else ""
    out += "-bf16stats" if c.stats_dtype == "bfloat16" else ""
    return out + ("-codes" if c.weight_storage == "codes" else "")


def _policy_suffix(c) -> str:
    """``-pW8G8`` per distinct bits of the policy's rules (patterns are not in the name: it
    names output directories)."""
    fmt = lambda b: "F" if b is None else str(b)  # noqa: E731
    return "".join(dict.fromkeys(f"-pW{fmt(w)}G{fmt(g)}" for _, w, g in c.bit_policy))


def _level_suffix(c) -> str:
    """``-xW4`` / ``-xG4`` when the outer level's bits differ (``x``: across nodes)."""
    fmt = lambda b: "F32" if b is None else str(b)  # noqa: E731
    out = ""
    if c.outer_weight_bits != c.weight_bits:
        out += f"-xW{fmt(c.outer_weight_bits)}"
    if c.outer_grad_bits != c.grad_bits:
        out += f"-xG{fmt(c.outer_grad_bits)}"
    return out
