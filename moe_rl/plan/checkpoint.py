"""A training checkpoint: what it holds, how long its save takes at a storage bandwidth, and
the grace a stopped run needs to save its last step.

What is written (`moe_rl.learner.checkpoint_state.sharded_state`, megatron's dist_checkpointing):
the model's weights (the params dtype) and the optimizer state: an fp32 main copy of every
parameter plus Adam's two fp32 moments (12 bytes per element; megatron's distributed
optimizer writes its fp32 main shard for an fp32 model too, the replicated fp32 optimizer
only the moments), and with PPO's critic the same again for the critic (its frozen output
layer without optimizer state, plus the value head). RNG states, the schedule and the small
files are left out (kilobytes).

One copy: megatron writes a tensor only from its main replica (`keep_only_main_replica`), so
data-parallel copies are written once: the dense weights by data-parallel rank 0 (the first
TP ranks of each pipeline stage, megatron's "tp-cp-ep-dp-pp" order), the experts by
expert-data-parallel rank 0 (the first EP x ETP ranks), the tensor-parallel-replicated norms
and routers by TP rank 0; the optimizer state with its weights, or under the distributed
optimizer by every data-parallel rank its own shard (`fully_sharded_model_space`; the largest
shard is taken for each rank, an upper bound by the padding). Each rank writes its part at the
same time as every other rank.

Time of a synchronous save (`run.async_save=false`, and the stopped step's save):
  host copy   the rank's tensors copied to host memory (the largest rank's bytes at
              `Hardware.host_copy_gbps`; every GPU copies at once)
  write       the node's bytes at `Hardware.storage_gbps` (nodes write in parallel)
  verify      each rank hashes the files it wrote for the manifest as soon as they are
              written (`moe_rl.learner.checkpoint_writes.DcpWrite`): read back, at worst from
              storage (the node's bytes at `storage_gbps`; from the page cache it is
              faster), and SHA-256 at `Hardware.hash_gbps` per rank, the slower of the two
Under `run.async_save` the step waits only for the host copy (the save's start); the write
and the verify run in the writer thread beside the steps, and the finish (metadata, the
small files' hashes, the manifest, the rename) takes a moment at a later step boundary.
megatron's collective save planning is not counted.

Grace (SIGTERM): the step in progress finishes first (at worst a whole step), then
`Saves.on_stop` completes a save still in flight (what is left of its write and verify after
a step) and saves the stopped step synchronously if that fits in run.stop_grace_s. So
run.stop_grace_s must cover in-flight + a full save, and the launcher's kill delay
(torchrun --shutdown-timeout, SLURM's KillWait, both 30 s by default) a step + stop_grace_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_rl.config import ModelConfig, RunConfig
from moe_rl.plan.hardware import Hardware
from moe_rl.plan.model_state import optimizer_bytes_per_element
from moe_rl.plan.workload import PlannedLayout

if TYPE_CHECKING:  # the meta-device build imports megatron; this module needs only its type
    from moe_rl.learner.meta import MetaRank

LAUNCHER_KILL_S = 30.0
"""torchrun's default --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and SLURM's
default KillWait: seconds from SIGTERM to SIGKILL."""
TP_REPLICATED = ("norms", "router")
"""Kinds every tensor-parallel rank holds whole: megatron writes them from TP rank 0."""


def element_bytes(model: ModelConfig, distributed: bool) -> tuple[int, int]:
    """(weight, optimizer) bytes per parameter element in a checkpoint, on a GPU."""
    weight = 2 if model.dtype_on(True) == "bf16" else 4
    return weight, (12 if distributed else optimizer_bytes_per_element(weight))


def _weight_elements(rank: MetaRank, i: int, layout: PlannedLayout, tied: bool) -> tuple[int, int]:
    """(weight elements, of them the output layer's) the rank at offset `i` of its pipeline
    stage writes: dense weights from data-parallel rank 0, experts from expert-DP rank 0."""
    k = rank.params_by_kind
    output = 0 if tied else k["output"]  # a tied head on the last stage is the embedding's copy
    dense = sum(n for kind, n in k.items() if kind not in ("routed_experts", "output")) + output
    if i % layout.tp:
        dense -= sum(k[kind] for kind in TP_REPLICATED)
    written = (dense if i < layout.tp else 0) + (k["routed_experts"] if i < layout.ep * layout.etp else 0)
    return written, (output if i < layout.tp else 0)


def _rank_bytes(model: ModelConfig, rank: MetaRank, i: int, layout: PlannedLayout, distributed: bool,
                critic: bool) -> int:
    """Bytes the rank at offset `i` of `rank`'s pipeline stage writes (actor, and critic)."""
    w, o = element_bytes(model, distributed)
    tied = not model.untie_embeddings_and_output_weights
    weights, output = _weight_elements(rank, i, layout, tied)
    shard = sum(b.shard_numel for b in rank.buffers)
    optimizer = shard if distributed else weights
    out = weights * w + optimizer * o
    if critic:  # its own copy; its frozen output layer has no optimizer state
        head = model.hidden_size if rank.pp_rank == layout.pp - 1 and i == 0 else 0
        frozen = -(-rank.params_by_kind["output"] // layout.dp) if distributed else output
        out += (weights + head) * w + (optimizer - frozen + head) * o
    return out


def _check_order(rank: MetaRank, layout: PlannedLayout) -> None:
    """The writers above assume megatron's "tp-cp-ep-dp-pp" order: the data-parallel groups
    stride by TP and the expert-DP groups by EP x ETP from the stage's first rank (the built
    one); megatron's own groups of that rank must say so."""
    first, n = rank.rank, layout.learners // layout.pp
    if (rank.groups.dp != tuple(range(first, first + n, layout.tp))
            or rank.groups.expert_dp != tuple(range(first, first + n, layout.ep * layout.etp))):
        raise RuntimeError(f"rank {first}: data-parallel groups {rank.groups.dp} / {rank.groups.expert_dp} are not "
                           "megatron's tp-cp-ep-dp-pp order the checkpoint plan assumes")


def rank_writes(model: ModelConfig, metas: list[MetaRank], layout: PlannedLayout, distributed: bool,
                critic: bool) -> list[int]:
    """Bytes each learner rank writes, by global rank (stage s is ranks [s*S, (s+1)*S));
    `critic`: PPO's critic is saved too."""
    per_stage = layout.learners // layout.pp
    out = []
    for rank in sorted(metas, key=lambda r: r.pp_rank):
        _check_order(rank, layout)
        out += [_rank_bytes(model, rank, i, layout, distributed, critic) for i in range(per_stage)]
    return out


def total_bytes(model: ModelConfig, params_total: int, output_total: int, distributed: bool,
                critic: bool) -> tuple[int, int]:
    """(weights, optimizer) bytes of one copy of the model (and of the critic, when `critic`)."""
    w, o = element_bytes(model, distributed)
    weights, optimizer = params_total * w, params_total * o
    if critic:
        head = model.hidden_size
        weights += (params_total + head) * w
        optimizer += (params_total - output_total + head) * o
    return weights, optimizer


def per_node(per_rank: list[int], gpus_per_node: int) -> list[int]:
    """Bytes per node: ranks fill nodes in order (torchrun's --nproc-per-node per node)."""
    return [sum(per_rank[n:n + gpus_per_node]) for n in range(0, len(per_rank), gpus_per_node)]


def _ceil10(seconds: float) -> int:
    return int(math.ceil(seconds / 10) * 10)


@dataclass(frozen=True)
class CheckpointPlan:
    """One checkpoint of the plan: sizes (bytes), save times (seconds) at `Hardware`'s
    storage, host-copy and hash rates, and the stop's grace."""

    weights_bytes: int
    """One copy of the weights (actor, and critic)."""
    optimizer_bytes: int
    """One copy of the optimizer state (fp32 main params and Adam's moments)."""
    rank_bytes: int
    """The most one rank writes (and stages in host memory for a background write)."""
    node_bytes: int
    """The most one node writes."""
    host_copy_s: float
    write_s: float
    verify_s: float
    step_s: float
    """The planned step (the step in progress a signal waits for)."""
    async_save: bool
    stop_grace_s: float
    """The recipe's run.stop_grace_s."""

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.optimizer_bytes

    @property
    def save_s(self) -> float:
        """A synchronous save: host copy, write, verify."""
        return self.host_copy_s + self.write_s + self.verify_s

    @property
    def blocking_s(self) -> float:
        """What a save costs the steps: all of it, or under run.async_save the host copy at
        its start (the write and verify run beside the steps)."""
        return self.host_copy_s if self.async_save else self.save_s

    @property
    def in_flight_s(self) -> float:
        """At a stop, completing a background save begun a step earlier: what is left of
        its write and verify (0 without background saves)."""
        return max(0.0, self.write_s + self.verify_s - self.step_s) if self.async_save else 0.0

    @property
    def stop_grace_needed_s(self) -> float:
        """run.stop_grace_s that saves the stopped step: a save in flight, then a full save."""
        return self.in_flight_s + self.save_s

    @property
    def recommended_stop_grace_s(self) -> int:
        return max(_ceil10(self.stop_grace_needed_s), _ceil10(self.stop_grace_s))

    @property
    def kill_grace_needed_s(self) -> float:
        """Seconds from SIGTERM to SIGKILL the launcher must allow: the step in progress
        (at worst a whole one) and the stop's saves."""
        return self.step_s + self.stop_grace_needed_s

    @property
    def recommended_kill_grace_s(self) -> int | None:
        """torchrun --shutdown-timeout / SLURM KillWait for the recommended stop grace."""
        if not math.isfinite(self.step_s):
            return None
        return _ceil10(self.step_s + self.recommended_stop_grace_s)

    @property
    def stop_grace_ok(self) -> bool:
        return self.stop_grace_s >= self.stop_grace_needed_s

    @property
    def kill_grace_ok(self) -> bool:
        return LAUNCHER_KILL_S >= self.kill_grace_needed_s


def checkpoint_plan(model: ModelConfig, run: RunConfig, metas: list[MetaRank], layout: PlannedLayout,
                    params_total: int, output_total: int, distributed: bool, critic: bool, step_s: float,
                    hw: Hardware) -> CheckpointPlan:
    """The checkpoint of `model` (and of PPO's critic, when `critic`) at `layout` (`metas`: one
    build per pipeline stage) on `hw`, `distributed` as the plan's switches say, `step_s` the
    planned step; `run` gives the saves' mode and the stop's grace."""
    writes = rank_writes(model, metas, layout, distributed, critic)
    nodes = per_node(writes, hw.gpus_per_node)
    weights, optimizer = total_bytes(model, params_total, output_total, distributed, critic)
    return CheckpointPlan(
        weights_bytes=weights, optimizer_bytes=optimizer, rank_bytes=max(writes), node_bytes=max(nodes),
        host_copy_s=max(writes) / (hw.host_copy_gbps * 1e9),
        write_s=max(nodes) / (hw.storage_gbps * 1e9),
        verify_s=max(max(nodes) / (hw.storage_gbps * 1e9), max(writes) / (hw.hash_gbps * 1e9)),
        step_s=step_s, async_save=run.async_save, stop_grace_s=run.stop_grace_s,
    )
