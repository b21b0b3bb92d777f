"""Named compile targets: TPU topologies and NVIDIA GPUs, as the real compilers see them.

A target is compiled for ahead of time on this CPU host (no chip): TPUs through libtpu
(``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)``), GPUs
through the CUDA plugin with a ``GpuTargetConfigProto`` in text form describing the chip. Each
target also carries the published figures the step-time model needs (HBM, peak dense bf16 rate,
HBM bandwidth, the link bandwidth inside a slice or node); they are inputs of a model, printed
beside its output, never measurements.

GPU descriptions: the figures of XLA's own target configs
(``xla/backends/gpu/target_config/specs/{h100_sxm,h200,b200}.txtpb`` in the openxla/xla
repository, read 2026-12-07), rendered here with only the fields jaxlib 0.10.2 parses: it
rejects the newer ``feature_extension`` and the per-unit rate descriptions.
"""

from __future__ import annotations

import dataclasses
import os

GB = 1e9


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The facts of one NVIDIA GPU that its ``GpuTargetConfigProto`` text needs."""

    name: str
    major: int
    minor: int
    core_count: int
    memory_bandwidth: int  # bytes/s
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int
    pcie_bandwidth: int


H100 = GpuSpec("NVIDIA H100 80GB HBM3", 9, 0, 132, 3_352_320_000_000, 52_428_800, 1.98, 84_942_979_072, 34_359_738_368)
H200 = GpuSpec(
    "NVIDIA H200 141GB HBM3e", 9, 0, 132, 4_800_000_000_000, 52_428_800, 1.98, 151_397_597_184, 34_359_738_368
)
B200 = GpuSpec("NVIDIA B200", 10, 0, 148, 7_672_320_000_000, 132_644_864, 1.965, 191_514_411_008, 68_719_476_736)


def gpu_target_config(spec: GpuSpec) -> str:
    """``spec`` as ``GpuTargetConfigProto`` text (what ``get_topology_desc(target_config=...)`` takes)."""
    cc = f"{spec.major}.{spec.minor}"
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {spec.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {spec.memory_bandwidth}
  l2_cache_size: {spec.l2_cache_size}
  clock_rate_ghz: {spec.clock_rate_ghz}
  device_memory_size: {spec.device_memory_size}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {spec.major} minor: {spec.minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability {cc}a"
  device_address_bits: 64
  pcie_bandwidth: {spec.pcie_bandwidth}
  ecc_enabled: true
  name: "{spec.name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{spec.name}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target: how to get its devices, and the figures the step-time model uses.

    ``kind`` is ``"tpu"`` (``topology`` a libtpu topology name, e.g. ``"v5p:2x2x2"``, of each of
    ``slices`` slices joined by the data-center network) or ``"gpu"`` (``gpu`` its spec,
    ``topology`` ``"<hosts>x<gpus per host>"``). ``inter_gbps``: the bandwidths, per chip and
    direction in Gb/s, at which the two-level model prices collectives between nodes or slices.
    """

    name: str
    kind: str
    topology: str
    hbm_bytes: float
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per chip, one direction: ICI inside a slice, NVLink inside a node
    gpu: GpuSpec | None = None
    slices: int = 1
    inter_gbps: tuple[float, ...] = (100, 400)

    @property
    def n_chips(self) -> int:
        import math

        return self.slices * math.prod(int(d) for d in self.topology.split(":")[-1].split("x"))

    @property
    def chips_per_host(self) -> int:
        """The chips of one node of the two-level model: a GPU target's ``<gpus per host>``; a
        TPU target's slice, its chips all on the ICI."""
        return int(self.topology.split("x")[-1]) if self.kind == "gpu" else self.n_chips // self.slices

    @property
    def hosts(self) -> int:
        return self.n_chips // self.chips_per_host


# Published per-chip figures (vendor data sheets): dense bf16 peak, HBM, and one direction of
# the chip's links (TPU: ICI, all links; GPU: NVLink 4/5, 450/900 GB/s per direction). Between
# nodes: 100 and 400 Gb/s per GPU (one NIC per GPU); between TPU slices the data-center network's
# 50 Gb/s per v5p chip (Cloud TPU's v5p page: "DCN bandwidth per chip (Gbps) 50").
TARGETS = {
    "v5e-4": Target("v5e-4", "tpu", "v5e:2x2", 16 * GB, 197e12, 819 * GB, 200 * GB),
    "v5e-8": Target("v5e-8", "tpu", "v5e:2x4", 16 * GB, 197e12, 819 * GB, 200 * GB),
    "v5p-8": Target("v5p-8", "tpu", "v5p:2x2x2", 95 * GB, 459e12, 2765 * GB, 600 * GB),
    "v5p-64": Target("v5p-64", "tpu", "v5p:4x4x4", 95 * GB, 459e12, 2765 * GB, 600 * GB),
    "v5p-8x2": Target("v5p-8x2", "tpu", "v5p:2x2x2", 95 * GB, 459e12, 2765 * GB, 600 * GB, slices=2, inter_gbps=(50,)),
    "v6e-8": Target("v6e-8", "tpu", "v6e:2x4", 32 * GB, 918e12, 1640 * GB, 400 * GB),
    "h100-8": Target("h100-8", "gpu", "1x8", H100.device_memory_size, 989e12, H100.memory_bandwidth, 450 * GB, H100),
    "h100-16": Target("h100-16", "gpu", "2x8", H100.device_memory_size, 989e12, H100.memory_bandwidth, 450 * GB, H100),
    "h100-64": Target("h100-64", "gpu", "8x8", H100.device_memory_size, 989e12, H100.memory_bandwidth, 450 * GB, H100),
    "h200-8": Target("h200-8", "gpu", "1x8", H200.device_memory_size, 989e12, H200.memory_bandwidth, 450 * GB, H200),
    "b200-8": Target("b200-8", "gpu", "1x8", B200.device_memory_size, 2250e12, B200.memory_bandwidth, 900 * GB, B200),
}


def tpu_devices(topology: str, slices: int = 1) -> list:
    """The compile-only devices of ``slices`` slices of the TPU topology ``topology`` (e.g.
    ``"v5e:2x2"``), slice by slice (each device's ``slice_index`` says which).

    libtpu's one-process lock (``/tmp/libtpu_lockfile``) is turned off for this process
    (``ALLOW_MULTIPLE_LIBTPU_LOAD=1``): compiling needs no chip, and a second process (a test
    worker, a benchmark) failed with ``ABORTED: Internal error when accessing libtpu
    multi-process lockfile``.
    """
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if slices == 1:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, num_slices=slices)
    return sorted(desc.devices, key=lambda d: (d.slice_index, d.id))


def devices(target: Target) -> list:
    """The compile-only devices of ``target``, in the topology's order."""
    from jax.experimental import topologies

    if target.kind == "tpu":
        return tpu_devices(target.topology, target.slices)
    assert target.gpu is not None
    config = gpu_target_config(target.gpu)  # topology: 1 slice x hosts x GPUs per host
    desc = topologies.get_topology_desc(target.name, "cuda", target_config=config, topology=f"1x{target.topology}")
    return list(desc.devices)
