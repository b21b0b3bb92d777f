"""The compile-for-real-targets benchmark (experiments/bench/aot.py) and its schedule reader.

The schedule reader runs on hand-written HLO everywhere; the benchmark rows compile the tiny GPT
for a TPU topology (libtpu; CI installs it) and for H100s (the CUDA plugin, skipped without it).
"""

import importlib.util
import json
import os

import pytest

from experiments.shelf import schedule, step_model, targets

HLO = """HloModule m, num_partitions=8

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %r = f32[8]{0} call(%v), to_apply=%inner
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)
}

%inner (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), replica_groups=[1,8]<=[8], dimensions={0}, metadata={op_name="jit(f)/transpose(jvp())/all_gather"}
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %mm = f32[8]{0} fusion(%x), kind=kCustom, calls=%gemm
  %agd = f32[64]{0} all-gather-done(%ags)
  ROOT %s = f32[8]{0} slice(%agd), slice={[0:8]}
}

%fused (y: f32[8]) -> f32[8] {
  %y = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%y)
}

%rs_wrap (g: f32[64]) -> f32[8] {
  %g = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%g), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%fused
}

%gemm (m: f32[8]) -> f32[8] {
  %m = f32[8]{0} parameter(0)
  %m2 = f32[1,8]{1,0} reshape(%m)
  %d = f32[8,8]{1,0} dot(%m2, %m2), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %r = f32[8]{0} slice(%m), slice={[0:8]}
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %ars = f32[8]{0} all-reduce-start(%a), replica_groups=[1,8]<=[8], to_apply=%fused
  %ard = f32[8]{0} all-reduce-done(%ars)
  %ag = f32[64]{0} all-gather(%ard), replica_groups=[1,8]<=[8], dimensions={0}
  %rss = ((f32[64]{0}), f32[8]{0}) async-start(%ag), calls=%rs_wrap
  %f2 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused
  %rsd = f32[8]{0} async-done(%rss)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%z, %a)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_schedule_reads_what_runs_between_start_and_done():
    """An all-gather in a function the loop body calls, with an elementwise fusion and a matmul
    fusion between its start and done, in the backward pass: hidden, in the loop; an all-reduce
    whose done follows its start at once: exposed; a synchronous all-gather: exposed, not
    asynchronous; a reduce-scatter wrapped in an async-start with only an elementwise fusion
    before its async-done: exposed, counted once."""
    got = {s.kind: s for s in schedule.sites(HLO)}
    ag_loop = [s for s in schedule.sites(HLO) if s.in_loop]
    assert len(ag_loop) == 1 and ag_loop[0].hidden and ag_loop[0].backward and ag_loop[0].asynchronous
    assert ag_loop[0].bytes == 256 and ag_loop[0].dtype == "f32"
    assert got["all-reduce"].asynchronous and not got["all-reduce"].hidden
    sync = [s for s in schedule.sites(HLO) if s.kind == "all-gather" and not s.in_loop]
    assert len(sync) == 1 and not sync[0].asynchronous and not sync[0].hidden
    rs = got["reduce-scatter"]  # only an elementwise fusion while it travels: exposed
    assert rs.asynchronous and rs.compute_between == 1 and not rs.hidden and rs.bytes == 32
    assert (ag_loop[0].compute_between, ag_loop[0].matmuls_between) == (2, 1)
    summary = schedule.summary(schedule.sites(HLO))
    assert summary["backward loop"] == {"collectives": 1, "async": 1, "hidden": 1, "bytes": 256, "hidden_bytes": 256}
    assert summary["outside loops"]["collectives"] == 3 and summary["outside loops"]["hidden"] == 0


TPU_CHAIN = """HloModule m, num_partitions=8

%start_c (p: bf16[16]) -> (bf16[16], bf16[128]) {
  %p = bf16[16]{0} parameter(0)
  %ag1 = bf16[128]{0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(f)/transpose(jvp())/all_gather"}
  ROOT %t = (bf16[16]{0}, bf16[128]{0}) tuple(%p, %ag1)
}

%step_c (p: bf16[16], q: bf16[128], x: f32[8,8]) -> (f32[8,8], bf16[16], bf16[128]) {
  %p = bf16[16]{0} parameter(0)
  %q = bf16[128]{0} parameter(1)
  %x = f32[8,8]{1,0} parameter(2)
  %ag2 = bf16[128]{0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %d = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[8,8]{1,0}, bf16[16]{0}, bf16[128]{0}) tuple(%d, %p, %ag2)
}

%done_c (p: bf16[16], q: bf16[128]) -> bf16[128] {
  %p = bf16[16]{0} parameter(0)
  %q = bf16[128]{0} parameter(1)
  ROOT %ag3 = bf16[128]{0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%node_c (p: bf16[128]) -> (bf16[128], bf16[256]) {
  %p = bf16[128]{0} parameter(0)
  %ag4 = bf16[256]{0} all-gather(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  ROOT %t = (bf16[128]{0}, bf16[256]{0}) tuple(%p, %ag4)
}

ENTRY %main (a: bf16[16], x: f32[8,8]) -> (f32[8,8], bf16[256]) {
  %a = bf16[16]{0} parameter(0)
  %x = f32[8,8]{1,0} parameter(1)
  %async-collective-start = (bf16[16]{0}, bf16[128]{0}) fusion(%a), kind=kCustom, calls=%start_c
  %g0 = bf16[16]{0} get-tuple-element(%async-collective-start), index=0
  %g1 = bf16[128]{0} get-tuple-element(%async-collective-start), index=1
  %fusion.1 = (f32[8,8]{1,0}, bf16[16]{0}, bf16[128]{0}) fusion(%g0, %g1, %x), kind=kOutput, calls=%step_c
  %h0 = bf16[16]{0} get-tuple-element(%fusion.1), index=1
  %h1 = bf16[128]{0} get-tuple-element(%fusion.1), index=2
  %mm = f32[8,8]{1,0} get-tuple-element(%fusion.1), index=0
  %async-collective-done = bf16[128]{0} fusion(%h0, %h1), kind=kCustom, calls=%done_c
  %across = (bf16[128]{0}, bf16[256]{0}) fusion(%async-collective-done), kind=kCustom, calls=%node_c
  %n1 = bf16[256]{0} get-tuple-element(%across), index=1
  %tok = token[] after-all()
  %send.1 = (bf16[256]{0}, u32[], token[]) send(%n1, %tok), channel_id=9, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-gather.9_0"}
  %recv.1 = (bf16[512]{0}, u32[], token[]) recv(%tok), channel_id=10, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-gather.9_0"}
  %mm2 = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %send-done.1 = token[] send-done(%send.1), channel_id=9, is_host_transfer=true
  ROOT %o = (f32[8,8]{1,0}, bf16[256]{0}) tuple(%mm2, %n1)
}
"""


def test_xla_tpu_async_collective_fusion_is_one_collective_hidden_behind_its_steps():
    """XLA:TPU's async collective fusion (libtpu's async collective options) runs one all-gather
    in steps over a start fusion, a matmul fusion carrying a step, and a done fusion, each
    holding the same all-gather: the schedule reads one asynchronous all-gather with the matmul
    between its start and done, comm_report counts its bytes once; the all-gather over other
    replica groups that takes the done's result is a collective of its own (synchronous); what
    crosses TPU slices is a megascale send, hidden by the matmul before its send-done."""
    from qsdp_jax import comm

    found = schedule.sites(TPU_CHAIN)
    assert [(s.kind, s.bytes, s.asynchronous, s.hidden) for s in found] == [
        ("all-gather", 256, True, True),
        ("all-gather", 512, False, False),
        ("all-gather", 512, True, True),  # between two slices: a megascale send, a dot before its done
    ]
    assert found[0].backward and (found[0].compute_between, found[0].matmuls_between) == (1, 1)
    report = comm.comm_report_from_hlo(TPU_CHAIN, num_devices=8)
    got = sorted((c.kind, c.group_size, c.opcode, c.bytes_on_wire) for c in report.collectives)
    assert got == [
        ("all-gather", 2, "all-gather", 256.0),
        ("all-gather", 2, "send", 512.0),
        ("all-gather", 8, "all-gather", 224.0),
    ]
    assert report.warnings == ()


def test_gpu_target_config_names_the_chip():
    """The GpuTargetConfigProto text holds the spec's figures and only fields jaxlib 0.10 parses
    (no feature_extension, no per-unit rates)."""
    text = targets.gpu_target_config(targets.H100)
    assert "core_count: 132" in text and 'name: "NVIDIA H100 80GB HBM3"' in text
    assert "feature_extension" not in text and "rate_infos" not in text
    assert targets.TARGETS["h100-64"].n_chips == 64 and targets.TARGETS["v5p-64"].n_chips == 64


def _row_checks(row, kernels):
    assert row["kernels"] == kernels and row["n_chips"] == 4 or row["n_chips"] == 8
    assert 0 < row["peak_bytes"] < row["hbm_bytes"] and row["compile_s"] > 0
    assert row["trip_counts_known"], "the layer loops' trip counts were read"
    codes = "all-gather u32" if kernels == "pallas" else "all-gather u8"  # TPU: the payloads as words
    assert codes in row["wire_by_kind_dtype"], row["wire_by_kind_dtype"]
    assert row["overlap"] and row["model_time"]["step_s"] > row["model_time"]["compute_s"] >= 0


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None and os.environ.get("CI") != "true", reason="libtpu is not installed"
)
def test_a_tpu_row_compiles_with_the_pallas_kernels(tmp_path):
    """One row for a v5e:2x2 slice, tiny GPT, QSDP W8G8: compiled by XLA:TPU with the Mosaic
    kernels (what kernels="auto" runs on a TPU), its u8 gathers counted with the loops' trip
    counts read from the TPU's text; the JSON is written, a second run resumes (no compile), and
    --recount reads the kept compiled text to the same row."""
    from experiments.bench import aot

    out = tmp_path / "aot.json"
    hlo = ["--hlo-dir", str(tmp_path / "hlo")]
    args = ["--targets", "v5e-4", "--models", "tiny", "--schemes", "qsdp-W8G8", "--out", str(out), *hlo]
    assert aot.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    _row_checks(row, "pallas")
    assert row["compiler_flops"] > 0  # XLA:TPU's own cost analysis
    before = out.read_text()
    assert aot.main(args) == 0 and out.read_text() == before  # resumed: nothing compiled again
    assert aot.main(["--out", str(out), "--recount", "--targets", "v5e-4", "--models", "tiny", *hlo]) == 0
    assert json.loads(out.read_text())["rows"] == [row]  # the kept text read again: the same row


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda13_plugin") is None, reason="the CUDA plugin is not installed")
def test_a_gpu_row_compiles_for_h100():
    """One row for 8 H100s (our target-config text), tiny GPT, QSDP W8G8, compiled by XLA:GPU."""
    from experiments.bench import aot

    row = aot.measure(targets.TARGETS["h100-8"], "tiny", "qsdp-W8G8")
    _row_checks(row, "reference")
    assert row["chip"] == "NVIDIA H100 80GB HBM3"


def test_the_two_level_model_prices_node_spanning_collectives_at_the_inter_node_link():
    """2 x 8 GPUs: a gather inside node 0 moves at NVLink's rate, one across the nodes at the
    stated Gb/s; a hidden one overlaps the compute (the step is their max), an exposed one adds."""
    from experiments.bench import aot
    from qsdp_jax.comm import Collective, CommReport

    target = targets.TARGETS["h100-16"]
    assert (target.hosts, target.chips_per_host) == (2, 8) and targets.TARGETS["h100-8"].hosts == 1

    def gather(name, groups, nbytes):
        size = len(groups[0]) if groups else 16
        return Collective("all-gather", "u8", nbytes, size, 1, int(nbytes), name, "c", "all-gather-start", True, groups)

    inside = gather("in", (tuple(range(8)), tuple(range(8, 16))), 450e6)  # 1 ms at 450 GB/s
    across = gather("across", tuple((i, i + 8) for i in range(8)), 50e6)  # 1 ms at 400 Gb/s
    everyone = gather("all", (), 12.5e6)  # no groups: all 16 devices, 1 ms at 100 Gb/s
    report = CommReport((inside, across, everyone), 16)
    hidden = [schedule.Site("all-gather", "in", "u8", 0, "c", True, False, True, 3, 1)]
    flops = 1e-3 * target.n_chips * target.peak_bf16_flops  # 1 ms of compute per chip
    classes = step_model.collective_classes(report, hidden, 16, target.chips_per_host)
    assert [(c["group"], c["spans_nodes"], c["hidden"]) for c in classes] == [
        (2, True, False),
        (8, False, True),
        (16, True, False),
    ]
    m = aot.node_model(target, flops, classes, 400)
    assert m["intra_bytes"] == 450e6 and m["inter_bytes"] == 62.5e6
    assert m["hidden_comm_s"] == pytest.approx(1e-3) and m["compute_s"] == pytest.approx(1e-3)
    assert m["exposed_comm_s"] == pytest.approx(1e-3 + 0.25e-3)  # across at 400, all 16 at 400
    assert m["step_s"] == pytest.approx(2.25e-3)
    slow = aot.node_model(target, flops, classes, 100)
    assert slow["exposed_comm_s"] == pytest.approx(4e-3 + 1e-3)
    # 8 nodes (64 GPUs), the same compute per chip: the node-axis gather's group grows 2 -> 8,
    # the whole-mesh one 16 -> 64, the one inside a node keeps its 8
    big = aot.node_model(target, flops * 4, classes, 400, n_chips=64)
    assert big["compute_s"] == pytest.approx(1e-3) and big["intra_bytes"] == 450e6
    assert big["inter_bytes"] == pytest.approx(50e6 * (7 / 8) / (1 / 2) + 12.5e6 * (63 / 64) / (15 / 16))
    one = aot.node_model(target, flops / 2, classes, 400, n_chips=8)  # one node: nothing crosses
    assert one["inter_bytes"] == 0 and one["intra_bytes"] == pytest.approx(450e6 + 12.5e6 * (7 / 8) / (15 / 16))
    with pytest.raises(ValueError, match="whole number of 8-chip nodes"):
        aot.node_model(target, flops, classes, 400, n_chips=12)


def test_two_tpu_slices_are_the_two_levels_priced_at_the_data_center_network():
    """v5p-8x2: two v5p:2x2x2 slices, each a node of the two-level model, joined at DCN's 50 Gb/s
    per chip; with libtpu, its 16 compile-only devices come slice by slice."""
    target = targets.TARGETS["v5p-8x2"]
    assert (target.n_chips, target.hosts, target.chips_per_host, target.inter_gbps) == (16, 2, 8, (50,))
    assert targets.TARGETS["v5p-8"].hosts == 1 and targets.TARGETS["h100-16"].inter_gbps == (100, 400)
    if importlib.util.find_spec("libtpu") is not None:
        assert [d.slice_index for d in targets.devices(target)] == [0] * 8 + [1] * 8


def test_a_2level_scheme_is_a_node_local_mesh_and_only_for_our_steps():
    from experiments.shelf import schemes

    config = schemes.scheme_config("qsdp-W8G8+2level")
    assert (config.node_axis, config.axis_name, config.weight_bits) == ("node", "local", 8)
    assert schemes.mesh_axes("qsdp-W8G8+2level", 16, 2) == {"node": 2, "local": 8}
    assert schemes.mesh_axes("qsdp-W8G8", 16, 2) == "fsdp"
    with pytest.raises(ValueError, match="2level needs a qsdp_jax scheme"):
        schemes.split_scheme("gspmd+2level")
