"""The verdict: fits or not per phase, and when not, the smallest changes that make it fit,
each one re-planned (not guessed).

Kinds of change, cheapest first: megatron's distributed optimizer, full activation
recompute, a sleeping sampler during the update, micro-batches of one sequence, a wider
rollout TP (smaller weight shards per GPU), a vLLM memory budget sized to what the learner
leaves, optimizer CPU offload, a larger EP, more GPUs. Each single change (the mildest of
each kind) is re-planned; if none alone fits, the kinds are walked in that order taking
from each the alternative that shrinks the overshoot most, until the plan fits, and then
every change the fit does not need is dropped again (each drop re-planned).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from moe_rl.config import ConfigError
from moe_rl.plan.hardware import GIB, Hardware
from moe_rl.plan.memory import Switches
from moe_rl.plan.planner import ModelSource, Plan, make_plan

State = tuple[ModelSource, Hardware, Switches]


@dataclass(frozen=True)
class Change:
    text: str
    """How to make it: an override (key=value) or a command-line flag."""
    apply: Callable[[State], State]


@dataclass(frozen=True)
class Suggestion:
    changes: tuple[str, ...]
    plan: Plan


def _scaled_gpus(state: State, factor: int) -> State:
    """`state` on `factor` times its GPUs."""
    src, hw, sw = state
    return src, dataclasses.replace(hw, gpus=hw.gpus * factor), sw


def _then_cfg(first: Callable[[State], State], section: str, state: State, **values: Any) -> State:
    """`first`'s change, then `values` in recipe section `section`."""
    return _cfg(first(state), section, **values)


def _cfg(state: State, section: str, **values: Any) -> State:
    src, hw, sw = state
    cfg = src.cfg
    new = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
    return dataclasses.replace(src, cfg=new), hw, sw


def _sw(state: State, **values: Any) -> State:
    src, hw, sw = state
    return src, hw, dataclasses.replace(sw, **values)


def engine_host_load(plan: Plan) -> int:
    """The most any engine-hosting GPU holds in the rollout besides vLLM's budget."""
    return max(r.rollout - r.kinds["sampler_budget"] for r in plan.all_ranks if r.kinds["sampler_budget"])


def _budget_change(plan: Plan) -> Change | None:
    """gpu_memory_utilization as large as the rollout phase leaves room for, if that budget
    holds the engine's weights, workspace and one full-length sequence of KV cache."""
    mem = plan.hw.gpu_memory_bytes
    room = mem - engine_host_load(plan)
    need = (plan.sampler.weights_bytes + int(plan.hw.vllm_workspace_gib * GIB)
            + (plan.work.prompt_tokens + plan.work.response_tokens) * plan.sampler.kv_bytes_per_token)
    util = math.floor(room / mem * 100) / 100
    if util * mem < need or util == plan.cfg.sampler.gpu_memory_utilization:
        return None
    return Change(f"sampler.gpu_memory_utilization={util:.2f}",
                  lambda s: _cfg(s, "sampler", gpu_memory_utilization=util))


Group = Callable[[Plan], list[Change]]
"""Alternatives for one kind of change, mildest first, given the plan so far."""


def _switch_group(flag: str, text: str, **values: object) -> Group:
    def group(plan: Plan) -> list[Change]:
        if getattr(plan.switches, flag) == values.get(flag, True):
            return []
        return [Change(text, lambda s: _sw(s, **values))]
    return group


def _micro_batch(plan: Plan) -> list[Change]:
    if plan.cfg.parallel.micro_batch_size == 1:
        return []
    return [Change("parallel.micro_batch_size=1", lambda s: _cfg(s, "parallel", micro_batch_size=1))]


def _rollout_tp(plan: Plan) -> list[Change]:
    if not hasattr(plan.cfg.sampler, "tensor_parallel_size"):
        return []
    out, rtp = [], plan.work.rollout_tp * 2
    while rtp <= plan.hw.gpus:
        out.append(Change(f"sampler.tensor_parallel_size={rtp}",
                          partial(_cfg, section="sampler", tensor_parallel_size=rtp)))
        rtp *= 2
    return out


def _budget(plan: Plan) -> list[Change]:
    change = _budget_change(plan)
    return [change] if change else []


def _tensor_parallel(plan: Plan) -> list[Change]:
    """A wider TP inside a node (sequence parallel shards the activations with it)."""
    tp = plan.cfg.parallel.tensor_model_parallel_size * 2
    if tp > plan.hw.gpus_per_node or plan.cfg.model.num_query_groups % tp:
        return []
    return [Change(f"parallel.tensor_model_parallel_size={tp}",
                   lambda s: _cfg(s, "parallel", tensor_model_parallel_size=tp))]


def _expert_parallel(plan: Plan) -> list[Change]:
    out, ep = [], plan.cfg.parallel.expert_model_parallel_size * 2
    while plan.cfg.model.num_experts % ep == 0 and ep <= plan.hw.gpus:
        out.append(Change(f"parallel.expert_model_parallel_size={ep}",
                          partial(_cfg, section="parallel", expert_model_parallel_size=ep)))
        ep *= 2
    return out[:2]


def _more_gpus(plan: Plan) -> list[Change]:
    """More nodes, alone (more data parallelism: smaller optimizer shards) and with EP grown
    as much (fewer experts per GPU)."""
    out = []
    ep = plan.cfg.parallel.expert_model_parallel_size
    for f in (2, 4, 8):
        gpus = Change(f"--gpus {plan.hw.gpus * f}",
                      partial(_scaled_gpus, factor=f))
        out.append(gpus)
        if plan.cfg.model.num_experts % (ep * f) == 0:
            out.append(Change(f"{gpus.text} parallel.expert_model_parallel_size={ep * f}",
                              partial(_then_cfg, gpus.apply, "parallel", expert_model_parallel_size=ep * f)))
    return out


GROUPS: tuple[Group, ...] = (
    _switch_group("distributed_optimizer", "optimizer.distributed=true", distributed_optimizer=True),
    _switch_group("recompute", "model.recompute=full", recompute=True),
    _switch_group("sleep", "sampler.sleep_between_steps=true", sleep=True),
    _micro_batch,
    _tensor_parallel,
    _rollout_tp,
    _budget,
    _switch_group("offload_fraction", "optimizer.distributed=true optimizer.offload_fraction=1.0",
                  distributed_optimizer=True, offload_fraction=1.0),
    _expert_parallel,
    _more_gpus,
    _budget,
)


def _replan(plan: Plan, changes: list[Change]) -> Plan | None:
    state: State = (plan.source, plan.hw, plan.switches)
    for c in changes:
        state = c.apply(state)
    try:
        return make_plan(state[0], state[1], plan.work.prompt_tokens, state[2])
    except ConfigError:
        return None  # the change does not fit the layout (e.g. EP not dividing the world)


def overshoot(plan: Plan) -> int:
    """Bytes by which the plan misses (0: it fits): each phase's excess over GPU memory plus
    the engine's weights and workspace beyond its budget, summed so that a change helping
    any of them counts."""
    mem = plan.hw.gpu_memory_bytes
    return (max(0, plan.rollout_peak - mem) + max(0, plan.update_peak - mem)
            + max(0, -plan.sampler.kv_capacity_bytes))


def _prune(plan: Plan, chosen: list[Change], fitted: Plan) -> Suggestion:
    """Drop every change the fit does not need."""
    for c in list(chosen):
        trial = [x for x in chosen if x is not c]
        again = _replan(plan, trial)
        if again and again.fits:
            chosen, fitted = trial, again
    return Suggestion(tuple(c.text for c in chosen), fitted)


def _combined(plan: Plan, groups: tuple[Group, ...]) -> Suggestion | None:
    """Walk the groups in order; from each take the alternative that helps most, stopping as
    soon as the plan fits."""
    chosen: list[Change] = []
    current = plan
    for group in groups:
        best: tuple[int, Change, Plan] | None = None
        for change in group(current):
            p = _replan(plan, [*chosen, change])
            if p is None:
                continue
            if p.fits:
                return _prune(plan, [*chosen, change], p)
            if best is None or overshoot(p) < best[0]:
                best = (overshoot(p), change, p)
        if best and best[0] < overshoot(current):
            chosen.append(best[1])
            current = best[2]
    return None


def suggest(plan: Plan, limit: int = 4) -> list[Suggestion]:
    """Changes that make `plan` fit (empty when it fits): the single changes that suffice (at
    most `limit`, in `GROUPS` order, each with its own step time: recompute fits where a wider
    layout also would, at the cost of a forward per layer), else the smallest combination found."""
    if plan.fits:
        return []
    singles = []
    for group in GROUPS[:-2]:
        for change in group(plan)[:1]:
            p = _replan(plan, [change])
            if p and p.fits:
                singles.append(Suggestion((change.text,), p))
    if singles:
        return singles[:limit]
    found = _combined(plan, GROUPS)
    return [found] if found else []
