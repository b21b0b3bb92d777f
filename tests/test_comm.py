"""Tests for qsdp_jax.comm: wire bytes per device per step read from compiled HLO.

The first half compiles real shard_map programs on 8 simulated CPU devices and checks the byte
counts against hand-computed numbers; the second half feeds hand-written HLO (GPU/TPU forms
that the CPU backend never emits: async starts, iota groups, ...).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from qsdp_jax.comm import (
    Collective,
    CommReport,
    UnknownTripCountError,
    comm_report,
    comm_report_from_hlo,
    parse_replica_groups,
)

N = 8


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests/conftest.py should provide 8 CPU devices"
    return jax.make_mesh((N,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


def _sm(mesh, f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _only(report: CommReport) -> Collective:
    assert len(report.collectives) == 1, report.table(per_op=True)
    return report.collectives[0]


# ----------------------------------------------------------------------------------------------
# Real programs on 8 CPU devices


def test_all_gather_f32(mesh):
    f = _sm(mesh, lambda a: lax.all_gather(a, "fsdp", tiled=True), P("fsdp"), P())
    r = comm_report(f, jnp.zeros((N * 32,), jnp.float32))
    c = _only(r)
    # Result f32[256] = 1024 B per device; ring all-gather sends 7/8 of it.
    assert (c.kind, c.dtype, c.group_size, c.count) == ("all-gather", "f32", 8, 1)
    assert c.payload_bytes == 1024
    assert c.bytes_on_wire == 896.0
    assert r.total_bytes == 896.0
    assert r.by_kind() == {"all-gather": 896.0}
    assert r.by_dtype() == {"f32": 896.0}
    assert r.num_devices == 8


def test_psum_scatter(mesh):
    f = _sm(mesh, lambda a: lax.psum_scatter(a, "fsdp", tiled=True), P(), P("fsdp"))
    r = comm_report(f, jnp.zeros((64,), jnp.float32))
    c = _only(r)
    # Operand f32[64] = 256 B (looked up by name: 0.10 prints operands as %name only).
    assert (c.kind, c.payload_bytes, c.group_size) == ("reduce-scatter", 256, 8)
    assert c.bytes_on_wire == 224.0
    assert r.warnings == ()  # the operand was found, not derived from the result


def test_psum(mesh):
    f = _sm(mesh, lambda a: lax.psum(a, "fsdp"), P("fsdp"), P())
    r = comm_report(f, jnp.zeros((N * 24,), jnp.float32))
    c = _only(r)
    assert (c.kind, c.payload_bytes) == ("all-reduce", 96)
    assert c.bytes_on_wire == 2 * 96 * 7 / 8 == 168.0


def test_all_to_all_u8_tuple_form(mesh):
    f = _sm(mesh, lambda a: lax.all_to_all(a, "fsdp", 0, 0, tiled=True), P("fsdp"), P("fsdp"))
    x = jnp.zeros((N * 64,), jnp.uint8)
    compiled = f.lower(x).compile()
    # On CPU the all-to-all is the variadic (tuple) form with 8 operands of u8[8].
    assert "(u8[8]{0}, u8[8]{0}" in compiled.as_text()
    r = comm_report(compiled)
    c = _only(r)
    assert r.warnings == ()  # all 8 operands looked up by name
    assert (c.kind, c.dtype, c.payload_bytes, c.group_size) == ("all-to-all", "u8", 64, 8)
    assert c.bytes_on_wire == 56.0


def test_ppermute(mesh):
    perm = [(i, (i + 1) % N) for i in range(N)]
    f = _sm(mesh, lambda a: lax.ppermute(a, "fsdp", perm), P("fsdp"), P("fsdp"))
    c = _only(comm_report(f, jnp.zeros((N * 10,), jnp.float32)))
    assert (c.kind, c.payload_bytes, c.group_size) == ("collective-permute", 40, 8)
    assert c.bytes_on_wire == 40.0


def test_scan_trip_count(mesh):
    def fn(w):  # w: per device [4, 8]
        def body(carry, wi):
            return carry + lax.all_gather(wi, "fsdp", tiled=True).sum(), None

        return lax.scan(body, 0.0, w)[0]

    f = _sm(mesh, fn, P(None, "fsdp"), P())
    w = jnp.zeros((4, N * 8), jnp.float32)
    assert '"known_trip_count":{"n":"4"}' in f.lower(w).compile().as_text()
    r = comm_report(f, w)
    c = _only(r)
    # f32[64] = 256 B gathered per layer -> 224 B on the wire, 4 layers.
    assert (c.count, c.payload_bytes, c.trip_count_known) == (4, 256, True)
    assert c.bytes_on_wire == 4 * 224.0 == r.total_bytes
    assert c.computation != "main"  # it sits in the while body
    assert r.warnings == ()


def test_nested_scan(mesh):
    def fn(w):  # per device [2, 3, 8]
        def outer(carry, wo):
            def inner(c2, wi):
                return c2 + lax.all_gather(wi, "fsdp", tiled=True).sum(), None

            return lax.scan(inner, carry, wo)[0], None

        return lax.scan(outer, 0.0, w)[0]

    f = _sm(mesh, fn, P(None, None, "fsdp"), P())
    c = _only(comm_report(f, jnp.zeros((2, 3, N * 8), jnp.float32)))
    assert c.count == 6
    assert c.bytes_on_wire == 6 * 224.0


def test_checkpointed_scan_under_grad(mesh):
    """Forward loop gathers, backward loop re-gathers (remat) and reduce-scatters the grads."""

    def loss(w, x):  # w: per device [4, 2, 16] (rows sharded), x: [2, 16]
        def body(h, wi):
            return jnp.tanh(h @ lax.all_gather(wi, "fsdp", tiled=True)), None

        h, _ = lax.scan(jax.checkpoint(body), x, w)
        return h.sum()

    f = _sm(mesh, jax.grad(loss), (P(None, "fsdp"), P()), P(None, "fsdp"))
    r = comm_report(f, jnp.zeros((4, N * 2, 16), jnp.float32), jnp.zeros((2, 16), jnp.float32))
    layer = 16 * 16 * 4  # full f32[16,16] layer = 1024 B
    per_call = layer * 7 / 8  # 896 B
    assert r.by_kind() == {"all-gather": 2 * 4 * per_call, "reduce-scatter": 4 * per_call}
    gathers = [c for c in r.collectives if c.kind == "all-gather"]
    assert len(gathers) == 2 and len({c.computation for c in gathers}) == 2
    assert all(c.count == 4 and c.payload_bytes == layer for c in r.collectives)
    assert r.total_bytes == 10752.0


def test_report_accepts_plain_and_compiled(mesh):
    f = _sm(mesh, lambda a: lax.psum(a, "fsdp"), P("fsdp"), P())
    x = jnp.zeros((N * 4,), jnp.float32)
    compiled = f.lower(x).compile()
    a = comm_report(compiled)
    b = comm_report(f, jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert a == b and a.total_bytes == 2 * 16 * 7 / 8
    with pytest.raises(TypeError):
        comm_report(compiled, x)


def test_report_on_a_backend_without_hlo_text_says_so(mesh):
    """Compiled.as_text() is None where a backend has no text view: a clear error, not a bare
    TypeError from joining None."""
    f = _sm(mesh, lambda a: lax.psum(a, "fsdp"), P("fsdp"), P())
    compiled = f.lower(jnp.zeros((N * 4,), jnp.float32)).compile()

    class NoText:  # a jitted function whose compiled form has no text view
        def lower(self, *args):
            return self

        def compile(self):
            return self

        def as_text(self):
            return None

    with pytest.raises(NotImplementedError, match="no HLO text"):
        comm_report(NoText())
    assert comm_report(compiled).total_bytes > 0


# ----------------------------------------------------------------------------------------------
# Hand-written HLO text

_ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def _module(body: str, extra: str = "", header: str = "HloModule m, num_partitions=8") -> str:
    return f"{header}\n{_ADD}\n{extra}\nENTRY %main (p: f32[16]) -> f32[] {{\n{body}\n}}\n"


def test_iota_replica_groups():
    assert parse_replica_groups("[2,4]<=[8]", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_replica_groups("[2,4]<=[4,2]T(1,0)", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert parse_replica_groups("[1,8]<=[8]", 8) == (tuple(range(8)),)
    assert parse_replica_groups("{}", 4) == ((0, 1, 2, 3),)
    assert parse_replica_groups("{{0,1},{2,3}}", 8) == ((0, 1), (2, 3))
    # the mesh form, with the mesh's devices given (jax 0.10.2, a (replica, fsdp) step's psum)
    mesh_ids = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert parse_replica_groups(mesh_ids, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'b'}", 8) == ((0, 1), (2, 3), (4, 5), (6, 7))

    def ag(groups: str) -> Collective:
        hlo = _module(
            "  %p = f32[16]{0} parameter(0)\n"
            f"  ROOT %ag = f32[64]{{0}} all-gather(%p), channel_id=1, replica_groups={groups}, "
            "dimensions={0}, use_global_device_ids=true"
        )
        return _only(comm_report_from_hlo(hlo))

    for groups, n, wire in [
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", 4, 192.0),
        ("[2,4]<=[8]", 4, 192.0),
        ("[2,4]<=[4,2]T(1,0)", 4, 192.0),
        ("[4,2]<=[2,4]T(1,0)", 2, 128.0),
        ("[1,8]<=[8]", 8, 224.0),
    ]:
        c = ag(groups)
        assert (c.group_size, c.bytes_on_wire) == (n, wire), groups


def test_submesh_group_of_four_operand_lookup_and_inline():
    def rs(operand: str, param: str) -> CommReport:
        return comm_report_from_hlo(
            _module(
                f"  {param} = f32[64]{{0}} parameter(0)\n"
                f"  ROOT %rs = f32[16]{{0}} reduce-scatter({operand}), channel_id=2, "
                "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, "
                "dimensions={0}, to_apply=%add"
            )
        )

    # Operand by name (JAX 0.10 printing), and with its shape inline (older printing; the
    # name is then not needed in the table).
    for r in (rs("%p", "%p"), rs("f32[64]{0} %p", "%q")):
        c = _only(r)
        assert (c.kind, c.group_size, c.payload_bytes) == ("reduce-scatter", 4, 256)
        assert c.bytes_on_wire == 192.0
        assert r.warnings == ()
    # Operand defined nowhere: derived from the result (f32[16] * 4) with a warning.
    r = rs("%p", "%q")
    assert _only(r).payload_bytes == 256 and "operand shape not found" in r.warnings[0]


def test_group_of_one_is_free():
    hlo = _module(
        "  %p = f32[16]{0} parameter(0)\n"
        "  ROOT %ar = f32[16]{0} all-reduce(%p), replica_groups={{0},{1},{2},{3}}, to_apply=%add"
    )
    c = _only(comm_report_from_hlo(hlo))
    assert (c.group_size, c.bytes_on_wire) == (1, 0.0)


def test_async_all_gather_counted_once():
    hlo = _module(
        "  %p = f32[8]{0} parameter(0)\n"
        "  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, "
        'backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}\n'
        "  ROOT %agd = f32[64]{0} all-gather-done(%ags)"
    )
    r = comm_report_from_hlo(hlo)
    c = _only(r)
    assert (c.kind, c.opcode, c.payload_bytes) == ("all-gather", "all-gather-start", 256)
    assert r.total_bytes == 224.0


def test_async_all_reduce_start_empty_groups():
    hlo = _module(
        "  %p = f32[32]{0} parameter(0)\n"
        "  %ars = f32[32]{0} all-reduce-start(f32[32]{0} %p), replica_groups={}, to_apply=%add\n"
        "  ROOT %ard = f32[32]{0} all-reduce-done(f32[32]{0} %ars)"
    )
    # {} = all devices: the header says 8 partitions; an explicit num_devices wins.
    assert _only(comm_report_from_hlo(hlo)).bytes_on_wire == 2 * 128 * 7 / 8
    c = _only(comm_report_from_hlo(hlo, num_devices=4))
    assert (c.kind, c.group_size, c.bytes_on_wire) == ("all-reduce", 4, 192.0)
    four = hlo.replace("HloModule m, num_partitions=8", "HloModule m, num_partitions=4")
    assert _only(comm_report_from_hlo(four)).group_size == 4
    headless = hlo.replace("HloModule m, num_partitions=8", "HloModule m")
    assert _only(comm_report_from_hlo(headless)).group_size == jax.device_count()


def test_async_wrapped_and_sugared_reduce_scatter_and_permute():
    wrapped = """
%wrapped (wp: f32[64]) -> f32[8] {
  %wp = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(f32[64]{0} %wp), replica_groups={}, dimensions={0},
      to_apply=%add
}
"""
    hlo = _module(
        "  %p = f32[64]{0} parameter(0)\n"
        "  %st = ((f32[64]{0}), f32[8]{0}) async-start(f32[64]{0} %p), calls=%wrapped\n"
        "  %dn = f32[8]{0} async-done(((f32[64]{0}), f32[8]{0}) %st), calls=%wrapped\n"
        "  %rss = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(%p), replica_groups=[1,8]<=[8],"
        " dimensions={0}, to_apply=%add\n"
        "  %rsd = f32[8]{0} reduce-scatter-done(%rss)\n"
        "  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%p), "
        "source_target_pairs={{0,1},{1,0}}\n"
        "  ROOT %cpd = f32[64]{0} collective-permute-done(%cps)",
        extra=wrapped,
    )
    r = comm_report_from_hlo(hlo)
    assert sorted(c.opcode for c in r.collectives) == [
        "collective-permute-start",
        "reduce-scatter",
        "reduce-scatter-start",
    ]
    assert r.by_kind() == {"reduce-scatter": 2 * 224.0, "collective-permute": 256.0}
    cp = next(c for c in r.collectives if c.kind == "collective-permute")
    assert cp.group_size == 2
    # A permutation that moves nothing (self pairs only) costs nothing.
    self_only = hlo.replace("pairs={{0,1},{1,0}}", "pairs={{0,0},{1,1}}")
    assert comm_report_from_hlo(self_only).by_kind()["collective-permute"] == 0.0


def test_while_call_and_quoted_backend_config():
    """A collective in a computation called from a while body, escaped backend_config."""
    extra = """
%inner (ip: f32[16]) -> f32[16] {
  %ip = f32[16]{0} parameter(0)
  ROOT %ar = f32[16]{0} all-reduce(%ip), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}},
      to_apply=%add
}

%body (bp: (s32[], f32[16])) -> (s32[], f32[16]) {
  %bp = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[16]{0} get-tuple-element(%bp), index=1
  %c = f32[16]{0} call(%v), to_apply=%inner
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %c)
}

%cond (cp: (s32[], f32[16])) -> pred[] {
  %cp = (s32[], f32[16]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}
"""
    hlo = _module(
        "  %p = f32[16]{0} parameter(0)\n"
        "  %z = s32[] constant(0)\n"
        "  %t0 = (s32[], f32[16]{0}) tuple(%z, %p)\n"
        "  %w = (s32[], f32[16]{0}) while(%t0), condition=%cond, body=%body, "
        'backend_config="{\\"known_trip_count\\":{\\"n\\":\\"5\\"}}"\n'
        "  ROOT %o = f32[16]{0} get-tuple-element(%w), index=1",
        extra=extra,
    )
    c = _only(comm_report_from_hlo(hlo))
    assert (c.computation, c.count) == ("inner", 5)
    assert c.bytes_on_wire == 5 * 2 * 64 * 7 / 8
    # %inner also called once from the entry: multipliers of all call sites add up.
    twice = hlo.replace(
        "  %z = s32[] constant(0)\n", "  %z = s32[] constant(0)\n  %c2 = f32[16]{0} call(%p), to_apply=%inner\n"
    )
    c = _only(comm_report_from_hlo(twice))
    assert (c.count, c.bytes_on_wire) == (6, 6 * 112.0)


def _loop_module(backend_config: str) -> str:
    extra = """
%body (bp: (s32[], f32[8])) -> (s32[], f32[8]) {
  %bp = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%bp), index=1
  %ag = f32[64]{0} all-gather(%v), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %i = s32[] get-tuple-element(%bp), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %v)
}

%cond (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}
"""
    return _module(
        "  %t0 = (s32[], f32[8]{0}) parameter(0)\n"
        f"  %w = (s32[], f32[8]{{0}}) while(%t0), condition=%cond, body=%body{backend_config}\n"
        "  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1",
        extra=extra,
    )


def test_missing_trip_count_counts_once_with_warning():
    known = comm_report_from_hlo(_loop_module(', backend_config={"known_trip_count":{"n":"3"}}'))
    assert _only(known).count == 3 and known.total_bytes == 3 * 224.0

    r = comm_report_from_hlo(_loop_module(""))
    c = _only(r)
    assert (c.count, c.trip_count_known, c.bytes_on_wire) == (1, False, 224.0)
    assert len(r.warnings) == 1 and "known_trip_count" in r.warnings[0]
    assert "warning:" in r.table()
    with pytest.raises(UnknownTripCountError, match="%w"):
        comm_report_from_hlo(_loop_module(""), strict=True)


def test_dtypes_and_mixed_tuple():
    hlo = _module(
        "  %a = bf16[8]{0} parameter(0)\n"
        "  %b = f8e4m3fn[8]{0} parameter(1)\n"
        "  %c = s4[16]{0:E(4)} parameter(2)\n"
        "  %d = pred[] parameter(3)\n"
        "  ROOT %ag = (bf16[64]{0}, f8e4m3fn[64]{0}, s4[128]{0:E(4)}, pred[8]{0}) all-gather("
        "%a, %b, %c, %d), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
    )
    r = comm_report_from_hlo(hlo)
    assert {c.dtype: c.payload_bytes for c in r.collectives} == {"bf16": 128, "f8e4m3fn": 64, "s4": 64, "pred": 8}
    assert r.by_dtype() == {"bf16": 112.0, "f8e4m3fn": 56.0, "s4": 56.0, "pred": 7.0}
    assert {c.name for c in r.collectives} == {"ag"}
    assert r.by_kind_dtype()[("all-gather", "bf16")] == 112.0


def test_unknown_dtype_is_an_error():
    hlo = _module(
        "  %p = f99[8]{0} parameter(0)\n  ROOT %ag = f99[64]{0} all-gather(%p), replica_groups={}, dimensions={0}"
    )
    with pytest.raises(ValueError, match="unknown HLO element type 'f99'"):
        comm_report_from_hlo(hlo)


def test_as_dict_and_table():
    hlo = _module(
        "  %p = f32[16]{0} parameter(0)\n"
        "  %ag = f32[128]{0} all-gather(%p), replica_groups={}, dimensions={0}\n"
        "  ROOT %ar = f32[16]{0} all-reduce(%p), replica_groups={}, to_apply=%add"
    )
    r = comm_report_from_hlo(hlo)
    d = json.loads(json.dumps(r.as_dict()))
    assert d["total_bytes"] == 448.0 + 112.0
    assert d["by_kind_dtype"] == {"all-gather/f32": 448.0, "all-reduce/f32": 112.0}
    assert [c["name"] for c in d["collectives"]] == ["ag", "ar"]
    np.testing.assert_array_equal(sorted(d["by_kind"].values()), [112.0, 448.0])
    t = r.table()
    assert "all-gather" in t and "560" in t
    assert "main/ag" in r.table(per_op=True)


def test_conditional_branches_counted_as_upper_bound():
    extra = """
%b0 (x0: f32[16]) -> f32[16] {
  %x0 = f32[16]{0} parameter(0)
  ROOT %ar0 = f32[16]{0} all-reduce(%x0), replica_groups={}, to_apply=%add
}

%b1 (x1: f32[16]) -> f32[16] {
  %x1 = f32[16]{0} parameter(0)
  ROOT %n1 = f32[16]{0} negate(%x1)
}
"""
    hlo = _module(
        "  %p = f32[16]{0} parameter(0)\n"
        "  %i = s32[] constant(0)\n"
        "  ROOT %c = f32[16]{0} conditional(%i, %p, %p), branch_computations={%b0, %b1}",
        extra=extra,
    )
    r = comm_report_from_hlo(hlo)
    assert _only(r).computation == "b0" and r.total_bytes == 112.0
    assert len(r.warnings) == 1 and "conditional %c" in r.warnings[0]


def _tpu_style_loop(start: int, direction: str = "LT") -> str:
    """A loop as XLA:TPU prints it: no known_trip_count, the condition ``i < 5``, the counter
    entering as a copy of a constant."""
    extra = f"""
%body (bp: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %bp = (s32[], f32[8]{{0}}) parameter(0)
  %v = f32[8]{{0}} get-tuple-element(%bp), index=1
  %ag = f32[64]{{0:T(128)}} all-gather(%v), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{0}}
  %i = s32[] get-tuple-element(%bp), index=0
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%i, %v)
}}

%cond (cp: (s32[], f32[8])) -> pred[] {{
  %n = s32[]{{:T(128)}} constant(5)
  %cp = (s32[], f32[8]{{0}}) parameter(0)
  %c = s32[]{{:T(128)}} get-tuple-element(%cp), index=0
  ROOT %lt = pred[] compare(%c, %n), direction={direction}
}}
"""
    return _module(
        f"  %zero = s32[]{{:T(128)}} constant({start})\n"
        "  %z = s32[]{:T(128)} copy(%zero)\n"
        "  %x = f32[8]{0} parameter(0)\n"
        "  %t0 = (s32[], f32[8]{0}) tuple(%z, %x)\n"
        "  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body\n"
        "  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1",
        extra=extra,
    )


def test_trip_count_read_from_the_condition_where_xla_printed_none():
    """XLA:TPU's compiled loops carry no known_trip_count: ``i < 5`` from a constant 0 runs the
    body 5 times; a counter that starts elsewhere, or another comparison, stays unknown."""
    r = comm_report_from_hlo(_tpu_style_loop(0))
    assert (_only(r).count, _only(r).trip_count_known, r.warnings) == (5, True, ())
    for hlo in (_tpu_style_loop(1), _tpu_style_loop(0, "LE")):
        c = _only(comm_report_from_hlo(hlo))
        assert (c.count, c.trip_count_known) == (1, False)


def test_a_tpu_reduce_scatter_fusion_counts_as_a_reduce_scatter():
    """XLA:TPU prints a reduce-scatter as a fusion calling %all-reduce-scatter*, an all-reduce
    and a dynamic slice inside: (N-1)/N of the input on the wire, not an all-reduce's twice that."""
    extra = """
%all-reduce-scatter.3 (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  %ar = f32[64]{0:T(128)} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %pid = u32[] partition-id()
  ROOT %ds = f32[8]{0} dynamic-slice(%ar, %pid), dynamic_slice_sizes={8}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""
    hlo = _module(
        "  %x = f32[64]{0} parameter(0)\n  ROOT %f = f32[8]{0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.3",
        extra=extra,
    )
    c = _only(comm_report_from_hlo(hlo))
    assert (c.kind, c.payload_bytes, c.bytes_on_wire) == ("reduce-scatter", 256, 224.0)


def _megascale(op: str, shape: str, rendezvous: str, channel: int) -> str:
    attrs = f'_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="{rendezvous}"'
    arg = "%x, %tok" if op == "send" else "%tok"
    return (
        f"  %{op}.{channel} = ({shape}, u32[], token[]) {op}({arg}), channel_id={channel}, "
        f"is_host_transfer=true, frontend_attributes={{{attrs}}}\n"
    )


def test_collectives_between_tpu_slices_are_read_from_the_megascale_sends():
    """XLA:TPU compiled for several slices sends what crosses them as host transfers to the
    megascale runtime, the rendezvous naming the collective: counted once, at the send, over
    the slice count read from the all-gather's recv (3 parts): an all-gather sends its 64-byte
    part to 2 other slices, an all-to-all 2/3 of its 3 chunks, an all-reduce twice 2/3 of its
    buffer; recvs and the dones add nothing."""
    body = (
        "  %x = u8[1,64]{1,0} parameter(0)\n  %tok = token[] after-all()\n"
        + _megascale("send", "u8[1,64]{1,0}", "all-gather.8_0", 1)
        + _megascale("recv", "u8[3,64]{1,0}", "all-gather.8_0", 2)
        + "  %sd = token[] send-done(%send.1), channel_id=1, is_host_transfer=true\n"
        + _megascale("send", "u32[3,16]{1,0}", "all_to_all.55_0", 3)
        + _megascale("send", "f32[24]{0}", "all-reduce.29_0", 4)
        + "  ROOT %r = f32[] constant(0)"
    )
    report = comm_report_from_hlo(_module(body))
    got = {(c.kind, c.dtype, c.group_size, c.opcode, c.payload_bytes, c.bytes_on_wire) for c in report.collectives}
    assert got == {
        ("all-gather", "u8", 3, "send", 64, 128.0),
        ("all-to-all", "u32", 3, "send", 192, 128.0),
        ("all-reduce", "f32", 3, "send", 96, 128.0),
    }
    assert report.warnings == ()
