"""The TPU kernels and the train step compiled by the real TPU compiler (libtpu), ahead of time,
on this CPU machine: ``jax.experimental.topologies`` gives compile-only devices of a named TPU
topology. ``jax.export`` alone lowers a ``tpu_custom_call`` without running Mosaic's compiler,
so it is no evidence that a kernel compiles; these tests compile. Skipped where libtpu is not
installed (``pip install -e '.[aot-tpu]'``); in CI (``CI=true``) a missing libtpu fails instead,
since ``.ci/run`` installs it.

The full matrix (every kernel at bits 1..8 on v4, v5e, v5p and v6e, and buckets of 128..4096)
is ``python -m experiments.bench.tpu_kernels``; here a slice of it keeps the suite short.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsdp_jax as q
import toymodel
from qsdp_jax import kernels as qk
from qsdp_jax import optim
from qsdp_jax.kernels import _pallas as kp
from qsdp_jax.kernels import compile_errors

if os.environ.get("CI") == "true":
    import libtpu  # noqa: F401  (CI installs it: a missing compiler must fail there, not skip)
else:
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[aot-tpu]')")
from experiments.bench import tpu_kernels  # noqa: E402  (after the skip: it needs libtpu)
from experiments.shelf import schedule  # noqa: E402
from experiments.shelf.targets import tpu_devices  # noqa: E402

GENERATIONS = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2")


@pytest.mark.parametrize("topology", GENERATIONS)
def test_every_kernel_compiles_for_each_tpu_generation(topology):
    """Each of the 7 kernels at 3 and 8 bits (bit planes, bytes) with 1024-element buckets (the
    default), and 1 bit (whole codes per byte) with 128-element buckets: compiled by Mosaic, not
    only exported. (The whole matrix, bits 1..8 and buckets 128/1024/4096 on each generation, is
    ``python -m experiments.bench.tpu_kernels``: 660 of 660 compiled.)"""
    cases = tpu_kernels.cases(bits_list=(3, 8), buckets=(1024,)) + tpu_kernels.cases((1,), (128,))
    rows = tpu_kernels.compile_cases(topology, cases)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    assert len(rows) == 7 * 3 - 1  # no 1-bit shift rounding


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_the_sum_over_64_senders_compiles(topology):
    """The gradient's dequantize-and-sum over the payloads of 64 devices (a v5p-64 pod's
    reduce-scatter) within the scoped VMEM: 16 senders failed on v5p before the sum's blocks
    shrank with the sender count."""
    rows = tpu_kernels.compile_cases(topology, [("unpack_dequantize_sum", 8, 1024)], senders=64)
    assert all(r["ok"] for r in rows), rows


def _toy_step(topology, kernels, weights, grads, bucket=128):
    """The toy model's train step on a TPU topology, compiled ahead of time."""
    devices = tpu_devices(topology)
    mesh = q.make_mesh(devices=devices)
    if weights is None:
        cfg = q.QSDPConfig.fp32(min_shard_size=128)
    else:
        cfg = q.QSDPConfig.qsdp(weights, grads, kernels=kernels, bucket_size=bucket, min_shard_size=128)
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toymodel.batch(0, n=8 * len(devices)))
    return q.make_train_step(toymodel.loss, opt, mesh, cfg).lower(state, batch).compile()


@pytest.mark.parametrize("weights,grads", [(None, None), (8, 8)])
def test_train_step_compiles_for_v5e_with_the_pallas_kernels(weights, grads):
    """CI's smoke compile: the fp32 and the QSDP W8G8 step for a v5e:2x2 slice, with
    ``kernels="pallas"``: the W8G8 program holds the Mosaic kernels (the encode of the weights,
    the gradients' quantize+pack, the decode, the sum) and sends its gradient payloads and its
    weights' codes as 32-bit words, fp32 none; both give a memory analysis."""
    compiled = _toy_step("v5e:2x2", "pallas", weights, grads)
    text = compiled.as_text()
    calls = text.count('custom_call_target="tpu_custom_call"')
    if weights is None:
        assert calls == 0
    else:
        for name in ("qsdp_quantize_pack_grid_8b", "qsdp_quantize_pack_stochastic_8b", "qsdp_unpack_dequantize"):
            assert name in text, name
        # the gradients' all-to-all moves 32-bit words on TPU (tpu_wire.all_to_all_words: XLA:TPU
        # compiles a uint8 all-to-all in time linear in its size)
        a2a = [
            line.split(" = ", 1)[1].split("all-to-all")[0]  # the result's shape
            for line in text.splitlines()
            if "all-to-all(" in line or "all-to-all-start(" in line
        ]
        assert a2a and all("u32[" in lhs and "u8[" not in lhs for lhs in a2a), a2a
        # the weights' codes travel in an all-gather of u32 words, not an all-reduce of the
        # gathered buffer (what XLA:TPU makes of an all-gather whose per-device part is not a
        # multiple of 128 elements; tpu_wire.all_gather_rows pads the payloads)
        by = q.comm.comm_report_from_hlo(text, num_devices=4).by_kind_dtype()
        assert by.get(("all-gather", "u32"), 0) > 0 and by.get(("all-reduce", "u32"), 0) < 1024, by
        assert ("all-gather", "u8") not in by, by
    assert " conditional(" not in text  # cpu_boundary's conditional folds away off the CPU
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    # overlap=True (the default) on TPU: the layer loops prefetch the next layer and XLA:TPU's
    # async collective options run every layer-loop collective under the layer's matmuls
    found = schedule.summary(schedule.sites(text))
    for name in ("forward loop", "backward loop"):
        row = found[name]
        assert row["collectives"] >= 1 and row["hidden"] == row["collectives"], (name, found)
    kinds = {s.kind for s in schedule.sites(text) if s.in_loop and s.backward}
    assert kinds == {"all-gather", "all-to-all"}, kinds  # the gradient's scatter: an all-to-all


def test_without_overlap_a_tpu_step_neither_prefetches_nor_hides():
    """``overlap=False``: no TPU options and no prefetch: the forward loop's gather is exposed."""
    from qsdp_jax._src.collective import overlap

    mesh = q.make_mesh(devices=tpu_devices("v5e:2x2"))
    assert overlap.prefetch_layers(mesh, True) == overlap.Prefetch(scatter_by_all_to_all=True)
    assert overlap.compiler_options(mesh, True) == overlap.TPU_OPTIONS
    assert overlap.prefetch_layers(mesh, False) is None and overlap.compiler_options(mesh, False) is None
    two = q.make_mesh(devices=tpu_devices("v5e:2x2", slices=2))  # across slices: psum_scatter
    assert overlap.prefetch_layers(two, True) == overlap.Prefetch(scatter_by_all_to_all=False)
    cfg = q.QSDPConfig.qsdp(8, 8, kernels="reference", bucket_size=128, min_shard_size=128)
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toymodel.batch(0, n=32))
    step = q.make_train_step(toymodel.loss, opt, mesh, cfg, overlap=False)
    found = schedule.summary(schedule.sites(step.lower(state, batch).compile().as_text()))
    assert found["forward loop"]["hidden"] == 0, found


def test_two_slices_make_the_outer_axis_and_their_two_level_step_compiles():
    """A multislice job (two v5e:2x2 slices over the data-center network): make_mesh puts the
    slices on the outer axis of ("node", "local"), so QSDP's inter-node stage is the one that
    crosses the slices, and the two-level W8G8 step compiles for them: XLA:TPU sends the weight
    codes and the gradients (as u32 words) between the slices as megascale host transfers
    (comm_report reads them, ``hlo_megascale``), and runs the rest inside each slice."""
    devices = tpu_devices("v5e:2x2", slices=2)
    assert [d.slice_index for d in devices] == [0] * 4 + [1] * 4
    mesh = q.make_mesh({"node": 2, "local": 4}, devices=devices)
    assert [{d.slice_index for d in row} for row in mesh.devices] == [{0}, {1}]
    cfg = q.QSDPConfig.qsdp(
        8, 8, node_axis="node", axis_name="local", kernels="reference", bucket_size=128, min_shard_size=128
    )
    opt = optim.qsdp(optax.adam(1e-2), cfg)
    state = q.abstract_train_state(toymodel.init(0), opt, mesh, cfg, stacked=toymodel.STACKED)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toymodel.batch(0, n=64))
    text = q.make_train_step(toymodel.loss, opt, mesh, cfg).lower(state, batch).compile().as_text()
    report = q.comm.comm_report_from_hlo(text, num_devices=8)
    across = {(c.kind, c.dtype, c.group_size) for c in report.collectives if c.opcode == "send"}
    inside = {(c.kind, c.dtype, c.replica_groups) for c in report.collectives if c.opcode != "send"}
    assert {("all-gather", "u32", 2), ("all-to-all", "u32", 2)} <= across, across
    assert {("all-gather", "u32", ((0, 1, 2, 3),)), ("all-to-all", "u32", ((0, 1, 2, 3),))} <= inside, inside


@pytest.mark.parametrize("grad_dtype", ["uint8", "bfloat16"])
def test_all_to_all_as_words_holds_no_padded_buffer_on_tpu(monkeypatch, grad_dtype):
    """The quantized (uint8) and the bf16 reduce-scatter, their all-to-all as 32-bit words on TPU
    (``tpu_wire.all_to_all_words``), need no more memory than with the 8/16-bit all-to-all: a
    bitcast through a ``(..., 4)`` uint8 array, whose minor dimension TPU layouts pad, took a
    quantized reduce-scatter's temp from 504 to 1786 MB on v5p, and the W8G8 Gemma 3 270M step's
    v5p peak from 4.9 to 31.5 GB."""
    from jax.sharding import Mesh, PartitionSpec as P

    from qsdp_jax import collectives as qc

    devices = tpu_devices("v5e:2x2")
    mesh = Mesh(np.array(devices), ("x",))
    n = len(devices) * 128 * 1024 + 8 * 1024  # per device: one chunk of 130 whole buckets per peer

    def body(full, key):
        if grad_dtype == "uint8":
            return qc.quantized_reduce_scatter(full, bits=8, bucket=1024, axis_name="x", key=key[0])
        return qc.reduce_scatter_fp(full, axis_name="x", dtype="bfloat16")

    def temp_bytes():
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False))
        args = jax.ShapeDtypeStruct((len(devices) * n,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.uint32)
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    words = temp_bytes()
    monkeypatch.setattr(qc, "all_to_all_words", lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=False))
    plain = temp_bytes()
    assert words <= 1.1 * plain + (1 << 16), (words, plain)


def test_buckets_the_tpu_kernels_do_not_take_use_the_reference():
    """A 64-element bucket is not whole 128-lane rows: the step compiles with the jnp reference
    on the TPU instead of a kernel Mosaic would refuse (``kernels="pallas"``)."""
    text = _toy_step("v5e:2x2", "pallas", 8, 8, bucket=64).as_text()
    assert "tpu_custom_call" not in text


def test_a_kernel_the_compiler_refuses_is_named_with_the_way_out(monkeypatch):
    """A real refusal by libtpu (a row block far past VMEM) becomes a KernelCompileError naming
    the kernel, the chip and ``kernels='reference'``, with XLA's error as its cause."""
    monkeypatch.setitem(kp._BLOCK_ELEMS, "mosaic_tpu", 1 << 21)
    devices = tpu_devices("v5e:2x2")
    kind = devices[0].device_kind
    fn = functools.partial(qk.quantize_pack, bits=4, bucket=1024, rounding="stochastic", target="mosaic_tpu")
    x = jax.ShapeDtypeStruct((1 << 21,), jnp.float32)
    with pytest.raises(qk.KernelCompileError) as info:
        with compile_errors.kernel_failures_explained(kind), tpu_kernels.on_device(devices[0]):
            jitted = jax.jit(
                lambda v: fn(v, key=jnp.uint32(3)), in_shardings=jax.sharding.SingleDeviceSharding(devices[0])
            )
            jitted.lower(x).compile()
    text = str(info.value)
    assert "qsdp_quantize_pack_stochastic_4b" in text and kind in text and "kernels='reference'" in text
    assert "vmem" in str(info.value.__cause__)


def test_other_errors_pass_unexplained():
    """Only a kernel's failure is rewritten: other errors, and a word like Triton in an error
    that names no kernel of ours, pass unchanged."""
    assert compile_errors.explain(ValueError("shapes do not match"), "TPU v5 lite") is None
    assert compile_errors.explain(RuntimeError("Triton is not installed"), "H100") is None
    with pytest.raises(ZeroDivisionError):
        with compile_errors.kernel_failures_explained("TPU v4"):
            1 / 0


@pytest.mark.parametrize("flags", [["--senders", "0"], ["--buckets", "100"]])
def test_the_kernel_matrix_refuses_bad_input(flags, capsys):
    with pytest.raises(SystemExit) as e:
        tpu_kernels.main([*flags, "--out", "/nonexistent/never.json"])
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
