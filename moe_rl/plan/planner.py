"""One plan: the recipe's model built per distinct rank on the meta device, its memory per
phase, its traffic and its time, at a world size on a given machine.

    src = resolve_model(load_recipe("examples/gpu/qwen3_30b_a3b.yaml")[0])
    p = make_plan(src, Hardware(gpus=16), prompt_tokens=1024)
    p.fits, p.params_total, p.ranks[0].kinds

`switches` plans a what-if (distributed optimizer, offload, recompute, sleeping sampler)
without the recipe having the field; the meta-device builds are cached per (model, layout,
world), so re-planning a what-if costs no new build.

This is the planner's one view of the whole recipe (`ModelSource.cfg`): it resolves and
checks it, and hands every other module the sections that module reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moe_rl.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    validate,
    validate_layout,
    validate_minibatches,
)
from moe_rl.plan.checkpoint import CheckpointPlan, checkpoint_plan
from moe_rl.plan.comms import Traffic, critic_passes, traffic
from moe_rl.plan.critic import critic_gemm_params, critic_state, has_critic, value_head_numel
from moe_rl.plan.hardware import Hardware
from moe_rl.plan.memory import RankMemory, Switches, engine_memory, rank_memory
from moe_rl.plan.model_source import planned_model
from moe_rl.plan.model_state import ModelState, model_state
from moe_rl.plan.sampler import SamplerMemory, sampler_memory
from moe_rl.plan.timing import critic_seconds, learner_seconds, optimizer_seconds, rollout_seconds
from moe_rl.plan.workload import (
    PlannedLayout,
    Workload,
    check_rollout_tp,
    critic_workload,
    workload,
)

if TYPE_CHECKING:  # the meta-device build imports megatron: resolving and checking a recipe need not
    from moe_rl.learner.meta import MetaRank


@dataclass(frozen=True)
class ModelSource:
    """The recipe with its model resolved, and where the model came from."""

    cfg: Config
    source: str
    """'recipe' or the config.json path."""
    notes: tuple[str, ...]
    """What the plan assumes that the checkpoint's config.json says otherwise."""

    def revised(self, section: str, **values: object) -> ModelSource:
        """The same source with fields of the recipe's `section` changed (a what-if)."""
        cfg = dataclasses.replace(self.cfg, **{section: dataclasses.replace(getattr(self.cfg, section), **values)})
        return dataclasses.replace(self, cfg=cfg)


def resolve_model(cfg: Config) -> ModelSource:
    """The recipe (as `load_recipe` gives it) with `model` taken from `run.init_checkpoint`'s
    config.json when there is one (`model_source.planned_model`), then validated: the model
    and layout checks see the checkpoint's model, not the recipe's default."""
    model, source, notes = planned_model(cfg.model, cfg.run.init_checkpoint)
    resolved = cfg if model is cfg.model else dataclasses.replace(cfg, model=model)
    validate(resolved)
    return ModelSource(resolved, source, notes)


def check_world(cfg: Config, world: int) -> None:
    """The trainer's layout and mini-batch checks at this world size, and the rollout TP's
    (cheap: no build)."""
    validate_minibatches(cfg, validate_layout(cfg, world))
    check_rollout_tp(cfg.sampler, cfg.model, world)


_BUILDS: dict[tuple[ModelConfig, ParallelConfig, int], list[MetaRank]] = {}
_COUNTS: dict[tuple[ModelConfig, int], dict[str, int]] = {}


def _built(what: str, build: Any) -> Any:
    """megatron refusing a shape (an assertion deep in a layer) is the recipe's error."""
    try:
        return build()
    except (AssertionError, ValueError) as e:
        raise ConfigError(f"megatron-core cannot build {what}: {' '.join(str(e).split()) or type(e).__name__}") from None


def meta_ranks(model: ModelConfig, parallel: ParallelConfig, world: int) -> list[MetaRank]:
    """One meta-device build per pipeline stage of `model` at `parallel`'s layout (cached)."""
    from moe_rl.learner.meta import build_meta_ranks

    # micro-batch size and backend do not change what a rank holds: one build serves all
    key = (model, dataclasses.replace(parallel, micro_batch_size=1, distributed_backend="auto"), world)
    if key not in _BUILDS:
        _BUILDS[key] = _built(f"this layout at {world} GPUs", lambda: build_meta_ranks(model, parallel, world))
    return _BUILDS[key]


def param_counts(model: ModelConfig, parallel: ParallelConfig) -> dict[str, int]:
    """The whole model's parameter elements by kind (cached per model and EP)."""
    from moe_rl.learner.meta import model_param_counts

    key = (model, parallel.expert_model_parallel_size)
    if key not in _COUNTS:
        _COUNTS[key] = _built("the model", lambda: model_param_counts(model, parallel))
    return _COUNTS[key]


def active_params(model: ModelConfig, by_kind: dict[str, int]) -> int:
    """Every parameter one token's forward touches: all but the E - K routed experts it skips
    (all experts of a layer are the same size)."""
    m = model
    routed = by_kind["routed_experts"]
    return sum(by_kind.values()) - routed + routed // m.num_experts * m.moe_router_topk


@dataclass(frozen=True)
class Plan:
    cfg: Config
    source: ModelSource
    hw: Hardware
    layout: PlannedLayout
    work: Workload
    switches: Switches
    params_by_kind: dict[str, int]
    """The whole model's parameter elements by kind (`moe_rl.learner.meta.KINDS`)."""
    sampler: SamplerMemory
    ranks: tuple[RankMemory, ...]
    """One per distinct learner rank (pipeline stage)."""
    engine: RankMemory | None
    """The engine-only ranks under `sampler.placement=separate`, else None."""
    traffic: tuple[tuple[Traffic, ...], ...]
    """Per distinct rank, by family."""
    times: dict[str, float]
    """Seconds per step by part (the slowest rank's where ranks differ)."""
    critic_work: Workload | None
    """PPO's critic's own update shapes (`workload.critic_workload`), or None without a critic."""
    checkpoint: CheckpointPlan
    """A checkpoint's size, save time and the stop's grace (`moe_rl.plan.checkpoint`)."""

    @property
    def params_total(self) -> int:
        return sum(self.params_by_kind.values())

    @property
    def params_active(self) -> int:
        return active_params(self.cfg.model, self.params_by_kind)

    @property
    def all_ranks(self) -> tuple[RankMemory, ...]:
        return self.ranks + ((self.engine,) if self.engine else ())

    @property
    def rollout_peak(self) -> int:
        return max(r.rollout for r in self.all_ranks)

    @property
    def update_peak(self) -> int:
        return max(r.update for r in self.all_ranks)

    @property
    def fits_rollout(self) -> bool:
        return self.sampler.starts and self.rollout_peak <= self.hw.gpu_memory_bytes

    @property
    def fits_update(self) -> bool:
        return self.update_peak <= self.hw.gpu_memory_bytes

    @property
    def fits(self) -> bool:
        return self.fits_rollout and self.fits_update


def _gemm_params(model: ModelConfig, by_kind: dict[str, int]) -> int:
    """Active parameters that are GEMM weights in the forward (the embedding lookup is not,
    unless the output layer reuses it)."""
    tied = not model.untie_embeddings_and_output_weights
    return active_params(model, by_kind) - (0 if tied else by_kind["embedding"])


def _optimizer_seconds(states: list[ModelState], sw: Switches, work: Workload, hw: Hardware) -> float:
    """The slowest rank's Adam steps per step."""
    out = []
    for state in states:
        off = int(state.optimizer * sw.offload_fraction)
        out.append(optimizer_seconds(state.optimizer - off, off, state.grads, state.params,
                                     sw.offload_fraction, work.updates, hw))
    return max(out)


def _critic_times(model: ModelConfig, layout: PlannedLayout, work: Workload, sw: Switches, by_kind: dict[str, int],
                  metas: list[MetaRank], hw: Hardware) -> dict[str, float]:
    """PPO's critic (`moe_rl.plan.critic`; `work`: its own workload): its compute, its traffic
    (the slowest rank's TP, EP, PP and DP for its passes) and its Adam steps."""
    gemm = critic_gemm_params(active_params(model, by_kind), by_kind)
    times = critic_seconds(model, layout, work, gemm, sw.recompute, hw)
    passes = critic_passes(layout, work, sw)
    times["critic_comms"] = max(
        sum(t.seconds for t in traffic(model, r, layout, work, sw, 0, hw, passes) if t.family != "weight_sync")
        for r in metas)
    states = [critic_state(r, sw.distributed_optimizer, layout.dp, value_head_numel(model, r, layout.pp))
              for r in metas]
    times["critic_optimizer"] = _optimizer_seconds(states, sw, work, hw)
    return times


def _times(model: ModelConfig, layout: PlannedLayout, work: Workload, critic_work: Workload | None, sw: Switches,
           by_kind: dict[str, int], sampler: SamplerMemory, metas: list[MetaRank], traffic_: list[list[Traffic]],
           hw: Hardware) -> dict[str, float]:
    gemm = _gemm_params(model, by_kind)
    times = {**rollout_seconds(model, work, gemm, sampler, hw),
             **learner_seconds(model, layout, work, gemm, sw.recompute, hw)}
    for family in ("tp", "ep", "pp", "dp"):
        times[family] = max(next(t.seconds for t in ts if t.family == family) for ts in traffic_)
    times["optimizer"] = _optimizer_seconds([model_state(m, sw.distributed_optimizer) for m in metas], sw, work, hw)
    if critic_work is not None:
        times.update(_critic_times(model, layout, critic_work, sw, by_kind, metas, hw))
    times["weight_sync"] = max(next(t.seconds for t in ts if t.family == "weight_sync") for ts in traffic_)
    times["total"] = sum(times.values())
    return times


def make_plan(source: ModelSource, hw: Hardware, prompt_tokens: int, switches: Switches | None = None) -> Plan:
    """Plan `source.cfg` on `hw` (world = hw.gpus); `switches` default to the recipe's."""
    cfg = source.cfg
    m = cfg.model
    check_world(cfg, hw.gpus)
    sw = switches or Switches.of(cfg.optimizer, m, cfg.sampler)
    if sw.offload_fraction and not sw.distributed_optimizer:
        raise ConfigError("optimizer.offload_fraction > 0 needs optimizer.distributed=true "
                          "(megatron offloads the distributed optimizer's shards)")
    layout = PlannedLayout.of(cfg.parallel, cfg.sampler, hw.gpus)
    work = workload(cfg.rl, cfg.sampler, cfg.parallel, layout, prompt_tokens)
    critic = has_critic(cfg.rl)
    # the critic's mini-batches: its own count, or (0) the actor's
    minibatches = cfg.critic.num_minibatches or cfg.rl.num_minibatches
    critic_work = critic_workload(cfg.parallel, layout, work, minibatches, cfg.critic.epochs) if critic else None
    metas = meta_ranks(m, cfg.parallel, layout.learners)
    by_kind = param_counts(m, cfg.parallel)
    sampler = sampler_memory(cfg.sampler, m, by_kind, work, hw)
    ranks = [rank_memory(m, cfg.rl, cfg.parallel, cfg.optimizer, r, layout, work, critic_work, sampler, hw, sw)
             for r in metas]
    traffic_ = [traffic(m, r, layout, work, sw, sampler.weights_bytes, hw) for r in metas]
    times = _times(m, layout, work, critic_work, sw, by_kind, sampler, metas, traffic_, hw)
    ckpt = checkpoint_plan(m, cfg.run, metas, layout, sum(by_kind.values()), by_kind["output"],
                           sw.distributed_optimizer, critic, times["total"], hw)
    return Plan(cfg, source, hw, layout, work, sw, by_kind, sampler, tuple(ranks),
                engine_memory(layout, sampler, hw, sw), tuple(tuple(t) for t in traffic_), times, critic_work, ckpt)
