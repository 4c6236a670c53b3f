"""The machine a plan is for: GPU memory, peak FLOP/s, link bandwidths, and the few
efficiency assumptions the time estimate makes. Defaults are an H100 SXM node (every one
overridable from the command line), so a plan states what it assumed.

Sources of the defaults: NVIDIA H100 SXM datasheet (989 TFLOP/s dense bf16, 1979 dense fp8,
3.35 TB/s HBM3, NVLink 4 at 900 GB/s bidirectional = 450 GB/s per direction); a 400 Gb/s
InfiniBand NIC per GPU = 50 GB/s; 79.2 GiB is what `torch.cuda.get_device_properties` reports
for an 80 GB H100 (the rest is reserved by the driver).

Checkpoint rates (`moe_rl.plan.checkpoint`), assumptions rather than datasheet figures: 2 GB/s
of shared-file-system writes per node is a conservative figure for one client of an NFS or
Lustre mount (one 25 GbE NFS client tops out near 3 GB/s; a Lustre client on InfiniBand over
many OSTs reaches 10+ GB/s): measure yours (e.g. `dd if=/dev/zero of=FILE bs=1M count=20000
oflag=direct` from every node at once) and pass --storage-gbps. 10 GB/s per GPU for the
save's host copy: pageable device-to-host copies, tensor by tensor (pinned PCIe 5 copies
reach ~50 GB/s; pageable ones commonly 10-20). 1 GB/s per process for the manifest's SHA-256
(OpenSSL reaches ~2 GB/s per core with the CPU's SHA extensions, ~0.5 without).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    gpus: int
    """World size: GPUs (= torchrun processes) in the run."""
    gpus_per_node: int = 8
    """GPUs per node: groups within a node talk over NVLink, across nodes over InfiniBand."""
    gpu_memory_gib: float = 79.2
    """Usable memory per GPU."""
    bf16_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s per GPU."""
    fp8_tflops: float = 1979.0
    """Peak dense fp8 TFLOP/s per GPU (used for the GEMMs when model.fp8 is on)."""
    hbm_tbps: float = 3.35
    """HBM bandwidth, TB/s (bounds decoding and the optimizer step)."""
    nvlink_gbps: float = 450.0
    """NVLink bandwidth per GPU per direction, GB/s."""
    ib_gbps: float = 50.0
    """Inter-node bandwidth per GPU per direction, GB/s."""
    pcie_gbps: float = 25.0
    """Host <-> GPU bandwidth per GPU, GB/s (optimizer CPU offload)."""
    mfu: float = 0.4
    """Fraction of peak FLOP/s the learner's GEMM mix reaches (MoE training: 0.3-0.45)."""
    bandwidth_efficiency: float = 0.7
    """Fraction of nominal link / HBM bandwidth collectives and kernels reach."""
    storage_gbps: float = 2.0
    """Checkpoint writes (and the manifest's read-back) per node, GB/s: the shared file
    system's bandwidth per client; nodes write in parallel."""
    host_copy_gbps: float = 10.0
    """A save's copy of each rank's tensors to host memory, GB/s per GPU (pageable D2H)."""
    hash_gbps: float = 1.0
    """SHA-256 of the checkpoint's files for its manifest, GB/s per process."""
    reserve_gib: float = 4.0
    """Per GPU: CUDA context, NCCL buffers, allocator fragmentation."""
    vllm_workspace_gib: float = 2.0
    """Per GPU inside vLLM's budget beside weights and KV cache (activations, sampler)."""

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node
