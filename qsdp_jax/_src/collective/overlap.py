"""Layer gathers hidden behind compute: the compiler options the train and eval steps are
jitted with (``make_train_step(..., overlap=True)``, the default).

XLA:GPU schedules a layer loop's collectives inside one iteration: a layer's all-gather is
issued and awaited before that layer's matmuls, with nothing to hide it behind (read from the
compiled program of GPT-125M on 8 H100s, ``experiments.bench.aot``). Its collective pipeliner
moves the next iteration's all-gather (and its operand's formatting: the packing of QSDP's uint8
payload included) into this iteration, and this iteration's gradient reduce-scatter into the
next, which is FSDP's prefetch done by the compiler; a second collective in flight lets the
backward loop's gather and its quantized gradient all-to-all both run under matmuls. The price
is one more layer's gathered weights, held while the previous layer computes (GPT-125M, 8 H100s:
fp32 799.8 -> 812.5 MB, W8G8 799.9 -> 810.2 MB per chip).

XLA:TPU does not pipeline a loop's collectives across iterations: with its async collective
options (:data:`TPU_OPTIONS`, MaxText's set) it runs a collective in steps under compute *of the
same iteration*, which hid some of the fp32 step's per-leaf gathers on v5p and none of QSDP's one
packed gather per layer (docs/design.md, "XLA:TPU's async collectives"). So on TPUs the program
prefetches itself (:func:`prefetch_layers`): the layer loops gather layer ``i + 1`` and
reduce-scatter layer ``i + 1``'s gradient in iteration ``i``
(:mod:`qsdp_jax._src.step.prefetch_scan`), and the step is compiled with those options. XLA:CPU
runs collectives synchronously: neither there.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

GPU_OPTIONS = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


TPU_OPTIONS = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_overlap_compute_collective_tc": True,
    "xla_enable_async_all_gather": True,
    "xla_tpu_enable_async_all_to_all": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_enable_async_all_reduce": True,
}


def _platform(mesh: Mesh, overlap: bool) -> str | None:
    """The mesh's one platform when ``overlap`` (else None).

    Raises:
      TypeError: ``overlap`` is not a bool.
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap={overlap!r}: must be True or False")
    platforms = {d.platform for d in mesh.devices.flat}
    return platforms.pop() if overlap and len(platforms) == 1 else None


def compiler_options(mesh: Mesh, overlap: bool) -> dict | None:
    """The options the step of ``mesh`` is jitted with when ``overlap``: :data:`GPU_OPTIONS` on
    GPUs, :data:`TPU_OPTIONS` on TPUs; else None (the compiler's defaults).

    Raises:
      TypeError: ``overlap`` is not a bool.
    """
    options: dict[str, dict] = {"gpu": GPU_OPTIONS, "tpu": TPU_OPTIONS}
    platform = _platform(mesh, overlap)
    return dict(options[platform]) if platform in options else None


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """How a step's layer loops prefetch (:func:`prefetch_layers`).

    Attributes:
      scatter_by_all_to_all: a float32 reduce-scatter of the 1-D mesh goes as an all-to-all and
        a sum (``GatherSpec.fp_by_all_to_all``), which XLA:TPU runs asynchronously beside the
        prefetched gather; only on one slice (across slices XLA splits the all-reduce form of a
        reduce-scatter by level, not an all-to-all: fp32 GPT-1.3B on two v5p slices, modelled,
        went 176 -> 554 ms with it).
    """

    scatter_by_all_to_all: bool = False


def prefetch_layers(mesh: Mesh, overlap: bool) -> Prefetch | None:
    """How the layer loops prefetch the next layer themselves, or None: on TPUs when
    ``overlap`` (module docstring). The price is one more layer's gathered weights per loop and
    one layer's weight gradient carried in the backward loop; XLA:TPU's peak rose by more than
    that (v5p-8, GPT-1.3B W8G8: 6085.9 -> 6591.6 MB per chip; docs/design.md).

    Raises:
      TypeError: ``overlap`` is not a bool.
    """
    if _platform(mesh, overlap) != "tpu":
        return None
    slices = {getattr(d, "slice_index", 0) for d in mesh.devices.flat}
    return Prefetch(scatter_by_all_to_all=len(slices) == 1)


def scan_blocks_default(mesh: Mesh, overlap: bool) -> bool:
    """Whether the NNX step runs chains of alike blocks as one scan (``qsdp_jax._src.nnx.chain``)
    when the user does not say: everywhere but under :data:`GPU_OPTIONS`. XLA:GPU's collective
    pipeliner on the chain's loops cost more compile time than the chain saved and hid fewer of
    its collectives than the scheduler hides in the unrolled calls (Gemma 3 270M's shapes, W8G8,
    8 H100s: unrolled 34.9 s and 27 of 54 collectives with a matmul between start and done;
    chained 47.3 s, the backward loop's 0 of 2; chained without the options 31.8 s). On XLA:CPU
    and XLA:TPU the chain compiles faster (W8G8 on XLA:CPU, side by side: 20.3 -> 14.2 s; on a
    v5p slice 444.7 s before it, 396.4 s with it)."""
    return _platform(mesh, overlap) != "gpu"
