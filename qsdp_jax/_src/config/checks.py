"""Field checks of :class:`qsdp_jax.config.QSDPConfig`: each failure is a ``ValueError`` that
names the field, the value it got and what is allowed."""

from __future__ import annotations

from typing import NoReturn

STATS_DTYPES = ("float32", "bfloat16")  # QSDPConfig.stats_dtype (re-exported by qsdp_jax.config)


def fail(field: str, value, allowed: str) -> NoReturn:
    raise ValueError(f"QSDPConfig.{field}={value!r} is invalid: must be {allowed}")


def check_int(field: str, value, *, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int):
        fail(field, value, f"an integer >= {minimum}")
    if value < minimum:
        fail(field, value, f"an integer >= {minimum}")


def check_bits(field: str, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 8:
        fail(field, value, "None (full precision) or an integer in 1..8")


def check_choice(field: str, value, choices):
    if value not in choices:
        fail(field, value, f"one of {', '.join(repr(c) for c in choices)}")


# The cross-field rules of QSDPConfig (its __post_init__ calls them with the config as `c`).

WEIGHT_STORAGES = ("float32", "codes")  # QSDPConfig.weight_storage


def check_storage(c):
    """Validate ``weight_storage``: codes only for weights kept on a grid."""
    check_choice("weight_storage", c.weight_storage, WEIGHT_STORAGES)
    if c.weight_storage == "codes" and c.weight_mode != "qsdp":
        fail(
            "weight_storage",
            "codes",
            f"'float32' with weight_mode={c.weight_mode!r}: only weights kept on their grid "
            "(weight_mode='qsdp') are their codes",
        )


def check_levers(c):
    """Validate ``grad_rotation`` and ``stats_dtype``."""
    r = c.grad_rotation
    if r is not None:
        if isinstance(r, bool) or not isinstance(r, int) or r < 2 or r & (r - 1):
            fail("grad_rotation", r, "None or a power of 2 >= 2 (a Hadamard block size)")
        if c.bucket_size % r:
            fail("grad_rotation", r, f"a block size dividing bucket_size={c.bucket_size}")
        if c.grad_bits is None:
            fail("grad_rotation", r, "None when grad_bits=None (only quantized gradients are rotated)")
        if c.outer_axis is not None:
            fail(
                "grad_rotation",
                r,
                "None on a two-level mesh (node_axis / replica_axis): "
                "the rotated reduce-scatter is implemented for 1-D meshes only",
            )
    check_choice("stats_dtype", c.stats_dtype, STATS_DTYPES)
    if c.stats_dtype != "float32":
        if c.weight_mode == "qsdp":
            fail(
                "stats_dtype",
                c.stats_dtype,
                "'float32' with weight_mode='qsdp': a bf16 grid reaches past its bucket's range, "
                "weights kept on it land there, and the range ratchets outward step after step "
                "(measured +55% validation loss at W4G4; experiments/grid_walk.py shows it); "
                "use weight_mode='comm' or 'full' for compact statistics",
            )
        if c.outer_axis is not None:
            fail(
                "stats_dtype",
                c.stats_dtype,
                "'float32' on a two-level mesh (node_axis / "
                "replica_axis): compact statistics are implemented for 1-D meshes only",
            )


def check_policy(c):
    """Validate ``bit_policy`` (lists are accepted and stored as tuples: hashable)."""
    policy = c.bit_policy
    if isinstance(policy, (str, bytes)) or not isinstance(policy, (tuple, list)):
        fail("bit_policy", policy, "a tuple of rules (pattern, weight_bits, grad_bits)")
    rules: list[tuple[str, int | None, int | None]] = []
    for i, rule in enumerate(policy):
        field = f"bit_policy[{i}]"
        if isinstance(rule, (str, bytes)) or not isinstance(rule, (tuple, list)) or len(rule) != 3:
            fail(field, rule, "a rule (pattern, weight_bits, grad_bits), e.g. ('embed/*', 8, 8)")
        pattern, wb, gb = rule
        if not isinstance(pattern, str) or not pattern.strip():
            fail(
                field,
                tuple(rule),
                "a rule whose pattern is a non-empty string (fnmatch on the leaf path 'group/key/...')",
            )
        for what, v in (("weight_bits", wb), ("grad_bits", gb)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 8):
                fail(field, tuple(rule), f"a rule whose {what} is None or an integer in 1..8")
        if pattern in [r[0] for r in rules]:
            fail(
                field,
                tuple(rule),
                f"a rule with a pattern not used before ({pattern!r} is "
                "rule "
                f"{[r[0] for r in rules].index(pattern)}; the first match wins, so this "
                "rule could never apply)",
            )
        check_rule_bits(c, field, (pattern, wb, gb))
        rules.append((pattern, wb, gb))
    object.__setattr__(c, "bit_policy", tuple(rules))


def check_rule_bits(c, field: str, rule: tuple):
    """A rule's bits obey the weight mode's rules (see the ``bit_policy`` docstring)."""
    _, wb, _ = rule
    mode = c.weight_mode
    if mode == "full" and wb is not None:
        fail(
            field,
            rule,
            "a rule with weight_bits None when weight_mode='full' (quantized "
            "weights need weight_mode 'qsdp' or 'comm')",
        )
    if mode == "qsdp" and wb is None and c.fp_comm_dtype != "float32":
        fail(
            field,
            rule,
            "a rule with weight_bits 1..8 when weight_mode='qsdp' and "
            f"fp_comm_dtype={c.fp_comm_dtype!r}: full-precision leaves (None) are "
            "gathered in fp_comm_dtype, which is lossless only in 'float32'",
        )
    if mode == "qsdp" and c.weight_rounding == "shift" and wb == 1:
        fail(
            field,
            rule,
            "a rule with weight_bits 2..8 (or None) with weight_mode='qsdp' and "
            "weight_rounding='shift': the shifted grid needs a spare level",
        )


def check_levels(c):
    """Validate the two-level fields (mesh axes and per-level bits)."""
    for field in ("node_axis", "replica_axis"):
        v = getattr(c, field)
        if v is not None and (not isinstance(v, str) or not v):
            fail(field, v, "None or a non-empty mesh axis name")
        if v is not None and v == c.axis_name:
            fail(field, v, f"an axis other than axis_name={c.axis_name!r}")
    if c.node_axis is not None and c.replica_axis is not None:
        fail(
            "replica_axis",
            c.replica_axis,
            f"None when node_axis={c.node_axis!r} is set (two levels at most: a mesh is "
            "either hierarchical (node_axis) or hybrid (replica_axis))",
        )
    check_bits("inter_weight_bits", c.inter_weight_bits)
    check_bits("inter_grad_bits", c.inter_grad_bits)
    for field in ("inter_weight_bits", "inter_grad_bits"):
        v = getattr(c, field)
        if v is not None and c.outer_axis is None:
            fail(
                field,
                v,
                "None on a 1-D mesh: per-level bits need two levels (set node_axis for a "
                "hierarchical ('node', 'local') mesh or replica_axis for a hybrid one)",
            )
    if c.inter_weight_bits is not None and c.weight_mode == "qsdp":
        if c.inter_weight_bits != c.weight_bits:
            fail(
                "inter_weight_bits",
                c.inter_weight_bits,
                f"None or equal to weight_bits={c.weight_bits} with weight_mode='qsdp': "
                "the weights live on one grid and every level forwards its codes, which keeps "
                "the gather lossless (per-level weight bits need weight_mode 'comm' or 'full')",
            )
    if c.replica_axis is not None and c.inter_weight_bits is not None:
        fail(
            "inter_weight_bits",
            c.inter_weight_bits,
            "None with replica_axis: a hybrid mesh gathers weights only inside a group",
        )
