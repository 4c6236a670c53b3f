"""The rules that span sections, in one place (each section's own rules are its `validate`):
the parallel layout against the model and the world size, the model's throughput levers
against routing, the RL step against the sampler's placement and engines, multi-turn
episodes against the task's template, PPO's critic against the run's length, and no NaN or
infinity anywhere."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from moe_rl.config.errors import ConfigError
from moe_rl.config.model import cuda_graph_scopes
from moe_rl.config.objective_hparams import OBJECTIVE_HPARAMS
from moe_rl.config.sections import Config


def check_finite(cfg: Config) -> None:
    """No NaN or infinity in any number of the recipe (YAML reads .nan and .inf)."""
    _finite(cfg, "")


def _finite(values: Any, prefix: str) -> None:
    for f in dataclasses.fields(values):
        v = getattr(values, f.name)
        if dataclasses.is_dataclass(v):
            _finite(v, f"{prefix}{f.name}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {v}")


def check_layout_against_model(cfg: Config) -> None:
    """The parallel sizes divide the model's shapes (the world size is `validate_layout`'s)."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if m.num_experts % ep:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by "
                          f"parallel.expert_model_parallel_size={ep}; pick an EP size that divides it")
    if m.num_attention_heads % tp:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"parallel.tensor_model_parallel_size={tp}")
    if m.num_query_groups % tp:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} is not divisible by "
                          f"parallel.tensor_model_parallel_size={tp} (each TP rank needs whole KV heads)")
    if m.num_layers % pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by "
                          f"parallel.pipeline_model_parallel_size={pp}")
    if m.moe_ffn_hidden_size % etp or m.ffn_hidden_size % tp:
        raise ConfigError("model.moe_ffn_hidden_size must be divisible by parallel.expert_tensor_parallel_size "
                          "and model.ffn_hidden_size by parallel.tensor_model_parallel_size")


def check_levers_against_routing(cfg: Config) -> None:
    """Capacity drops tokens a replayed routing sends; a graphed router skips the routing taps."""
    m, rl = cfg.model, cfg.rl
    if m.moe_expert_capacity_factor and rl.replay != "none":
        raise ConfigError(f"model.moe_expert_capacity_factor drops tokens the replayed routing sends to an expert "
                          f"(rl.replay={rl.replay}): set it to 0 or rl.replay=none")
    if cuda_graph_scopes(m.cuda_graph_scope) and rl.objective in OBJECTIVE_HPARAMS and rl.records_routing:
        raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope} graphs the router, which then replays its "
                          "captured kernels without the learner's routing taps: set rl.capture_routing=false and "
                          "rl.replay=none (and an objective without the router shift), or leave the router out "
                          "of the scope")


def check_rl_against_sampler(cfg: Config) -> None:
    """Asynchronous rollout needs engines of their own; segmented decoding and kept KV what
    the engines can do; offloading, a colocated synchronous run."""
    rl, s = cfg.rl, cfg.sampler
    if rl.max_staleness and s.placement != "separate":
        raise ConfigError(f"rl.max_staleness={rl.max_staleness} needs sampler.placement=separate: colocated engines "
                          "share the learner's devices, so sampling and training cannot overlap; set "
                          "sampler.placement=separate with sampler.engine_ranks, or rl.max_staleness=0")
    if cfg.optimizer.offload_during_rollout and (s.placement != "colocated" or rl.max_staleness):
        raise ConfigError("optimizer.offload_during_rollout is for colocated, synchronous runs (the learner's state "
                          "leaves the device its engine shares only while it waits for the rollout); with "
                          "separate engines or rl.max_staleness > 0 leave it false")
    if not rl.segmented:
        return
    which = "rl.inflight_weight_updates" if rl.inflight_weight_updates else "rl.partial_rollouts"
    if rl.inflight_kv == "keep" and s.backend != "vllm":
        raise ConfigError(f"rl.inflight_kv=keep runs vLLM's asynchronous engine; sampler.backend={s.backend} "
                          "decodes in segments: set sampler.backend=vllm or rl.inflight_kv=recompute")
    if rl.inflight_kv == "keep" and (s.tensor_parallel_size > 1 or s.sleep_between_steps):
        raise ConfigError("rl.inflight_kv=keep runs one engine process per engine rank: set "
                          "sampler.tensor_parallel_size=1 and sampler.sleep_between_steps=false")
    if s.max_restarts:
        raise ConfigError(f"sampler.max_restarts={s.max_restarts} is not implemented with {which}=true (the "
                          "engines decode segments at their own pace, so a failed one cannot be rebuilt and retried "
                          "in step with the others); set sampler.max_restarts=0 (an engine failure then ends the run "
                          "with one line)")


def check_episodes_against_task(cfg: Config) -> None:
    """Multi-turn episodes are rendered by the task's chat template and parsed by its parser."""
    rl, t = cfg.rl, cfg.task
    if t.agent:
        check_agent_against_run(cfg)
    if not rl.multi_turn:
        return
    if t.chat_template == "none":
        raise ConfigError(f"rl.max_turns={rl.max_turns} needs a chat template (tools, tool results and turns are "
                          "rendered by it); set task.chat_template=auto with a tokenizer that has one, or a .jinja file")
    if t.tool_parser != "auto" and t.tool_parser not in ("hermes", "glm45"):
        raise ConfigError(f"task.tool_parser={t.tool_parser}: use auto, hermes or glm45")


def check_agent_against_run(cfg: Config) -> None:
    """task.agent: multi-turn limits, and nothing that would need an agent replayed."""
    rl, t = cfg.rl, cfg.task
    if not rl.multi_turn:
        raise ConfigError(f"task.agent={t.agent}: an agent's episode is multi-turn; set rl.max_turns > 1 (its calls "
                          "per episode) and rl.max_turn_tokens (its tokens per call)")
    if rl.segmented:
        raise ConfigError(f"task.agent={t.agent}: partial rollouts and in-flight weight updates would need an agent "
                          "program paused and replayed; set rl.partial_rollouts=false and "
                          "rl.inflight_weight_updates=false")
    if cfg.sampler.tensor_parallel_size > 1:
        raise ConfigError(f"task.agent={t.agent}: the gateway drives one engine rank; set "
                          "sampler.tensor_parallel_size=1")


def check_critic_against_run(cfg: Config) -> None:
    """PPO's critic warm-up fits in the run."""
    c = cfg.critic
    if cfg.rl.uses_critic and c.warmup_steps > cfg.run.steps:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} is more than run.steps={cfg.run.steps} (equal: "
                          "a value-pretraining run, the critic alone on the starting policy's rollouts)")


CROSS_SECTION_CHECKS = (check_layout_against_model, check_levers_against_routing, check_rl_against_sampler,
                        check_episodes_against_task, check_critic_against_run)


def learner_world_size(cfg: Config, world_size: int) -> int:
    """Ranks that train: all of them, or those before the engine-only ranks (separate)."""
    return world_size - cfg.sampler.engine_ranks if cfg.sampler.placement == "separate" else world_size


def validate_layout(cfg: Config, world_size: int) -> int:
    """Check the parallel layout against the torchrun world size (the learner's part of it
    under separate placement); returns the data-parallel size."""
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if cfg.sampler.placement == "colocated" and world_size % cfg.sampler.tensor_parallel_size:
        raise ConfigError(
            f"world size {world_size} is not divisible by sampler.tensor_parallel_size="
            f"{cfg.sampler.tensor_parallel_size}; each engine takes that many consecutive ranks"
        )
    learners = learner_world_size(cfg, world_size)
    if learners < 1:
        raise ConfigError(f"sampler.engine_ranks={cfg.sampler.engine_ranks} leaves no learner rank of "
                          f"{world_size}; launch more processes")
    world_size = learners
    if world_size % (tp * pp):
        raise ConfigError(
            f"learner world size {world_size} is not divisible by tensor x pipeline parallel "
            f"({tp} x {pp}); launch a multiple of {tp * pp} processes"
        )
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"learner world size {world_size} is not divisible by expert-tensor x expert x pipeline "
            f"parallel ({etp} x {ep} x {pp}); launch a multiple of {etp * ep * pp} processes"
        )
    return world_size // (tp * pp)


def validate_minibatches(cfg: Config, dp: int) -> None:
    """Every mini-batch of an RL step holds a row on some rank: a rank holds at most
    ceil(prompts_per_step x group_size / dp) of the step's rows and splits them into the
    mini-batches, so more mini-batches than that would leave some empty and the trainer would
    run fewer updates than the recipe (and the learning-rate schedule, and the planner) count."""
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    per_rank = -(-rows // max(dp, 1))
    counts = {"rl.num_minibatches": cfg.rl.num_minibatches}
    if cfg.rl.uses_critic:
        counts["critic.num_minibatches"] = cfg.critic.num_minibatches
    for key, k in counts.items():
        if k > per_rank:
            raise ConfigError(f"{key}={k} is more mini-batches than the {per_rank} rows a data-parallel rank "
                              f"holds per step (rl.prompts_per_step x rl.group_size = {rows} over {dp} ranks); "
                              f"set it to at most {per_rank}")
