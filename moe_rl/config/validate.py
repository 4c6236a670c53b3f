"""Checks of a whole recipe that need no process group, one function per section, and the
layout check against the world size (which needs torchrun's WORLD_SIZE)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from moe_rl.config.coerce import choices_hint
from moe_rl.config.critic import validate_critic
from moe_rl.config.dpo import validate_dpo
from moe_rl.config.errors import ConfigError
from moe_rl.config.model import CUDA_GRAPH_SCOPES, cuda_graph_scopes
from moe_rl.config.objective_hparams import OBJECTIVE_HPARAMS
from moe_rl.config.reward_model import validate_reward_model
from moe_rl.config.sections import Config


def _require_positive(values: dict[str, int | float]) -> None:
    for key, v in values.items():
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")


def validate_model(cfg: Config) -> None:
    m = cfg.model
    _require_positive({
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads, "model.num_query_groups": m.num_query_groups,
        "model.kv_channels": m.kv_channels, "model.num_experts": m.num_experts,
        "model.moe_router_topk": m.moe_router_topk, "model.moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "model.vocab_size": m.vocab_size,
    })
    if m.moe_router_topk > m.num_experts:
        raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} must divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if not 0 <= m.num_dense_layers < m.num_layers:
        raise ConfigError(f"model.num_dense_layers={m.num_dense_layers} must be in [0, num_layers) "
                          "(at least one MoE layer)")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError("model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid")
    validate_throughput_settings(cfg)


def validate_throughput_settings(cfg: Config) -> None:
    """The learner's throughput levers against each other (their device is the preflight's):
    capacity and its padding, the CUDA graph scopes megatron-core accepts, and the routing
    the graphed router or dropped tokens would break."""
    m, rl = cfg.model, cfg.rl
    if m.moe_expert_capacity_factor < 0:
        raise ConfigError(f"model.moe_expert_capacity_factor must be >= 0 (0: no capacity), got "
                          f"{m.moe_expert_capacity_factor}")
    if m.moe_pad_expert_input_to_capacity and not m.moe_expert_capacity_factor:
        raise ConfigError("model.moe_pad_expert_input_to_capacity needs model.moe_expert_capacity_factor > 0 "
                          "(the capacity it pads to)")
    if m.moe_expert_capacity_factor and rl.replay != "none":
        raise ConfigError(f"model.moe_expert_capacity_factor drops tokens the replayed routing sends to an expert "
                          f"(rl.replay={rl.replay}): set it to 0 or rl.replay=none")
    scopes = cuda_graph_scopes(m.cuda_graph_scope)
    unknown = [x for x in scopes if x not in CUDA_GRAPH_SCOPES]
    if unknown or (not scopes and m.cuda_graph_scope.strip() != "none"):
        raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope!r}: expected none or a comma-separated "
                          f"subset of {', '.join(CUDA_GRAPH_SCOPES)}")
    rules = (
        ("full" in scopes and len(scopes) > 1, "full (whole layers) takes no other scope"),
        ("full" in scopes and not m.moe_pad_expert_input_to_capacity,
         "full needs model.moe_pad_expert_input_to_capacity=true (a whole MoE layer is graphed only with the "
         "capacity-padded dispatch: the dropless one syncs with the host)"),
        ("moe_preprocess" in scopes and "moe_router" not in scopes,
         "moe_preprocess needs moe_router (megatron graphs the preprocessing only after the router)"),
        (scopes and m.recompute != "none", "CUDA graphs cannot take model.recompute=full (megatron recomputes "
                                           "under graphs only for whole-iteration graphs); set one of them off"),
        ("moe_preprocess" in scopes and m.moe_expert_capacity_factor and m.moe_token_dispatcher_type == "alltoall",
         "moe_preprocess cannot take model.moe_expert_capacity_factor under the alltoall dispatcher (its "
         "preprocessing syncs with the host there)"),
    )
    for broken, why in rules:
        if broken:
            raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope}: {why}")
    if scopes and rl.objective in OBJECTIVE_HPARAMS and rl.records_routing:
        raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope} graphs the router, which then replays its "
                          "captured kernels without the learner's routing taps: set rl.capture_routing=false and "
                          "rl.replay=none (and an objective without the router shift), or leave the router out "
                          "of the scope")


def validate_parallel(cfg: Config) -> None:
    """The layout against the model's shapes (the world size is `validate_layout`'s)."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    _require_positive({
        "parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp,
        "parallel.expert_model_parallel_size": ep, "parallel.expert_tensor_parallel_size": etp,
        "parallel.micro_batch_size": p.micro_batch_size,
    })
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
    if tp > 1 and p.sequence_parallel is False:
        raise ConfigError("parallel.sequence_parallel=false with tensor_model_parallel_size>1: megatron-core "
                          "requires sequence parallel for MoE layers under TP; set it true or leave it unset")
    if p.max_tokens_per_microbatch < 0:
        raise ConfigError(f"parallel.max_tokens_per_microbatch must be >= 0 (0: micro_batch_size sequences), "
                          f"got {p.max_tokens_per_microbatch}")
    if p.manual_gc_interval < 0:
        raise ConfigError(f"parallel.manual_gc_interval must be >= 0 (0: Python's automatic collection), got "
                          f"{p.manual_gc_interval}")
    if p.max_tokens_per_microbatch and not p.packing:
        raise ConfigError("parallel.max_tokens_per_microbatch needs parallel.packing=true (a token budget bins "
                          "sequences of any length together, which only the packed layout can run)")


def validate_rl(cfg: Config) -> None:
    rl = cfg.rl
    _require_positive({"rl.group_size": rl.group_size, "rl.prompts_per_step": rl.prompts_per_step,
                       "rl.num_minibatches": rl.num_minibatches, "rl.epochs": rl.epochs})
    if rl.objective not in OBJECTIVE_HPARAMS:
        raise ConfigError(f"rl.objective={rl.objective!r} is unknown{choices_hint(rl.objective, OBJECTIVE_HPARAMS)}")
    if OBJECTIVE_HPARAMS[rl.objective].needs_router_shift and not rl.capture_routing:
        raise ConfigError(f"rl.objective={rl.objective} needs rl.capture_routing=true (router shift)")
    if rl.dynamic_sampling and rl.max_draws < 1:
        raise ConfigError("rl.max_draws must be >= 1 with rl.dynamic_sampling")
    if rl.overlong_max_len and not 0 <= rl.overlong_cache < rl.overlong_max_len:
        raise ConfigError("rl.overlong_cache must be in [0, rl.overlong_max_len)")
    if rl.max_staleness < 0:
        raise ConfigError(f"rl.max_staleness must be >= 0 (0: synchronous), got {rl.max_staleness}")
    if rl.max_staleness and cfg.sampler.placement != "separate":
        raise ConfigError(f"rl.max_staleness={rl.max_staleness} needs sampler.placement=separate: colocated engines "
                          "share the learner's devices, so sampling and training cannot overlap; set "
                          "sampler.placement=separate with sampler.engine_ranks, or rl.max_staleness=0")
    if cfg.optimizer.offload_during_rollout and (cfg.sampler.placement != "colocated" or rl.max_staleness):
        raise ConfigError("optimizer.offload_during_rollout is for colocated, synchronous runs (the learner's state "
                          "leaves the device its engine shares only while it waits for the rollout); with "
                          "separate engines or rl.max_staleness > 0 leave it false")
    if rl.segmented:
        _validate_segmented(cfg)
    if rl.max_turns < 1 or rl.max_turn_tokens < 0:
        raise ConfigError(f"rl.max_turns must be >= 1 and rl.max_turn_tokens >= 0, got {rl.max_turns} and "
                          f"{rl.max_turn_tokens}")
    if rl.multi_turn:
        _validate_multi_turn(cfg)
    if rl.max_staleness and rl.rollout_correction == "none" and rl.old_logprobs == "learner":
        raise ConfigError(f"rl.max_staleness={rl.max_staleness} trains on batches sampled by an older policy: set "
                          "rl.rollout_correction (tis, mis, icepop or is_rs) to correct for the sampler-learner gap, "
                          "or rl.old_logprobs=sampler")
    _validate_correction(cfg)


def _validate_correction(cfg: Config) -> None:
    """The rollout correction's knobs against its mode, OPSM and the bypass mode."""
    rl = cfg.rl
    try:
        rl.rollout_correction_args.check_mode(rl.rollout_correction)
    except ValueError as e:
        raise ConfigError(f"rl.rollout_correction_args: {e}") from None
    per_sequence = OBJECTIVE_HPARAMS[rl.objective].sequence_level
    if per_sequence and rl.rollout_correction_args.is_level == "token":
        raise ConfigError(f"rl.rollout_correction_args.is_level=token: rl.objective={rl.objective} is sequence-level "
                          "(one ratio per sequence); use is_level=sequence or geometric")
    if rl.opsm_delta is not None and rl.uses_critic:
        raise ConfigError(f"rl.opsm_delta masks whole sequences by their advantage's sign, and rl.advantage="
                          f"{rl.advantage} gives per-token advantages; leave rl.opsm_delta unset")
    if rl.old_logprobs not in ("learner", "sampler"):
        raise ConfigError(f"rl.old_logprobs={rl.old_logprobs!r}: choose learner or sampler")
    if rl.old_logprobs == "sampler":
        needs = ("rl.replay=R2 (it replays the scoring pass's routing)" if rl.replay == "R2" else
                 f"rl.objective={rl.objective} (its router-shift weight comes from the scoring pass)"
                 if OBJECTIVE_HPARAMS[rl.objective].needs_router_shift else
                 f"rl.rollout_correction={rl.rollout_correction} (d = old - rollout would be 0)"
                 if rl.rollout_correction != "none" else None)
        if needs:
            raise ConfigError(f"rl.old_logprobs=sampler skips the learner's scoring pass, which {needs} needs; "
                              "set rl.old_logprobs=learner")
        if rl.kl_in_reward:
            raise ConfigError("rl.old_logprobs=sampler with rl.kl_in_reward: the reward's KL needs the learner's "
                              "log-probs before the update; set rl.old_logprobs=learner")


def _validate_multi_turn(cfg: Config) -> None:
    rl, t = cfg.rl, cfg.task
    if t.chat_template == "none":
        raise ConfigError(f"rl.max_turns={rl.max_turns} needs a chat template (tools, tool results and turns are "
                          "rendered by it); set task.chat_template=auto with a tokenizer that has one, or a .jinja file")
    if rl.uses_critic:
        raise ConfigError(f"rl.max_turns={rl.max_turns} is not implemented with rl.advantage={rl.advantage} (a "
                          "critic's values over observation tokens are undefined here); use a group estimator")
    if t.tool_parser != "auto" and t.tool_parser not in ("hermes", "glm45"):
        raise ConfigError(f"task.tool_parser={t.tool_parser}: use auto, hermes or glm45")


def _validate_segmented(cfg: Config) -> None:
    rl = cfg.rl
    which = "rl.inflight_weight_updates" if rl.inflight_weight_updates else "rl.partial_rollouts"
    if rl.max_staleness < 1:
        raise ConfigError(f"{which}=true needs rl.max_staleness >= 1 (the engines run ahead of the learner) and "
                          "sampler.placement=separate")
    if rl.inflight_segment_tokens < 1:
        raise ConfigError(f"rl.inflight_segment_tokens must be >= 1, got {rl.inflight_segment_tokens}")
    if rl.inflight_push_after_segments < 0:
        raise ConfigError(f"rl.inflight_push_after_segments must be >= 0, got {rl.inflight_push_after_segments}")
    if rl.partial_oversample < 0:
        raise ConfigError(f"rl.partial_oversample must be >= 0, got {rl.partial_oversample}")
    if rl.async_schedule not in ("deterministic", "throughput"):
        raise ConfigError(f"rl.async_schedule={rl.async_schedule!r}: choose deterministic or throughput")
    if rl.inflight_kv == "keep":
        _validate_kept_kv(cfg)
    if cfg.sampler.max_restarts:
        raise ConfigError(f"sampler.max_restarts={cfg.sampler.max_restarts} is not implemented with {which}=true (the "
                          "engines decode segments at their own pace, so a failed one cannot be rebuilt and retried "
                          "in step with the others); set sampler.max_restarts=0 (an engine failure then ends the run "
                          "with one line)")


def _validate_kept_kv(cfg: Config) -> None:
    """rl.inflight_kv=keep: vLLM's streaming engine, paused when the push arrives."""
    rl, s = cfg.rl, cfg.sampler
    if s.backend != "vllm":
        raise ConfigError(f"rl.inflight_kv=keep runs vLLM's asynchronous engine; sampler.backend={s.backend} "
                          "decodes in segments: set sampler.backend=vllm or rl.inflight_kv=recompute")
    if rl.async_schedule != "throughput":
        raise ConfigError("rl.inflight_kv=keep pauses the engine when the learner's push arrives, which is not a fixed "
                          "token count: set rl.async_schedule=throughput (or rl.inflight_kv=recompute for the "
                          "deterministic schedule)")
    if s.tensor_parallel_size > 1 or s.sleep_between_steps:
        raise ConfigError("rl.inflight_kv=keep runs one engine process per engine rank: set "
                          "sampler.tensor_parallel_size=1 and sampler.sleep_between_steps=false")
    if rl.multi_turn:
        raise ConfigError(f"rl.max_turns={rl.max_turns}: multi-turn episodes decode in segments for now; set "
                          "rl.inflight_kv=recompute")


def validate_sampler(cfg: Config) -> None:
    s = cfg.sampler
    _require_positive({"sampler.max_new_tokens": s.max_new_tokens, "sampler.tensor_parallel_size":
                       s.tensor_parallel_size, "sampler.weight_sync_bucket_mib": s.weight_sync_bucket_mib})
    if s.tensor_parallel_size > 1 and s.backend != "vllm":
        raise ConfigError(f"sampler.tensor_parallel_size={s.tensor_parallel_size} needs sampler.backend=vllm "
                          "(the transformers sampler runs one whole model per rank)")
    if s.placement == "separate" and (s.engine_ranks < 1 or s.engine_ranks % s.tensor_parallel_size):
        raise ConfigError(f"sampler.placement=separate needs sampler.engine_ranks >= 1 and a multiple of "
                          f"sampler.tensor_parallel_size={s.tensor_parallel_size}, got {s.engine_ranks}")
    if s.placement == "colocated" and s.engine_ranks:
        raise ConfigError("sampler.engine_ranks is for sampler.placement=separate; leave it 0 when colocated")
    if s.sleep_between_steps and s.backend != "vllm":
        raise ConfigError("sampler.sleep_between_steps needs sampler.backend=vllm (vLLM's sleep mode)")
    if s.temperature <= 0:
        raise ConfigError(f"sampler.temperature must be > 0, got {s.temperature} (the learner scores at it too)")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"sampler.top_p must be in (0, 1], got {s.top_p}")


def validate_optimizer(cfg: Config) -> None:
    """Every optimizer section: the actor's and PPO's critic's (one section type)."""
    check_optimizer_section(cfg.optimizer, "optimizer")
    check_optimizer_section(cfg.critic.optimizer, "critic.optimizer")


def check_optimizer_section(o: Any, key: str) -> None:
    """One optimizer section's values, errors naming `key.<field>`."""
    _require({
        f"{key}.weight_decay": (o.weight_decay >= 0, f">= 0, got {o.weight_decay}"),
        f"{key}.adam_beta1": (0 <= o.adam_beta1 < 1, f"in [0, 1), got {o.adam_beta1}"),
        f"{key}.adam_beta2": (0 <= o.adam_beta2 < 1, f"in [0, 1), got {o.adam_beta2}"),
        f"{key}.adam_eps": (o.adam_eps > 0, f"> 0, got {o.adam_eps}"),
        f"{key}.clip_grad": (o.clip_grad >= 0, f">= 0 (0 disables clipping), got {o.clip_grad}"),
        f"{key}.lr_warmup_steps": (o.lr_warmup_steps >= 0, f">= 0, got {o.lr_warmup_steps}"),
        f"{key}.offload_fraction": (0 <= o.offload_fraction <= 1, f"in [0, 1], got {o.offload_fraction}"),
        f"{key}.lr": (o.lr > 0, f"> 0, got {o.lr}"),
        f"{key}.min_lr": (o.min_lr >= 0, f">= 0, got {o.min_lr}"),
    })
    if o.min_lr > o.lr:
        raise ConfigError(f"{key}.min_lr={o.min_lr:g} is above {key}.lr={o.lr:g} (the schedule decays from lr "
                          f"to min_lr): lower {key}.min_lr with it, e.g. {key}.min_lr={o.lr / 10:g}, or 0")
    if o.offload_fraction and not o.distributed:
        raise ConfigError(f"{key}.offload_fraction needs {key}.distributed=true (megatron offloads "
                          "the distributed optimizer's shards)")


def validate_run(cfg: Config) -> None:
    """Run length, cadence, seed and where the run directory is: `run.name` must stay inside
    `run.output_dir` (retention and temp clean-up delete inside the run directory)."""
    from pathlib import PurePath

    r = cfg.run
    _require_positive({"run.steps": r.steps})
    if r.save_every < 0:
        raise ConfigError(f"run.save_every must be >= 0 (0: only at the end), got {r.save_every}")
    _require({"run.save_every_minutes": (r.save_every_minutes >= 0, f">= 0 (0: by steps only), got {r.save_every_minutes}"),
              "run.stop_grace_s": (r.stop_grace_s >= 0, f">= 0 seconds, got {r.stop_grace_s}"),
              "run.max_skipped_updates": (r.max_skipped_updates >= 1,
                                          f">= 1 (skipped updates in a row before the run stops), got {r.max_skipped_updates}"),
              "sampler.max_restarts": (cfg.sampler.max_restarts >= 0, f">= 0, got {cfg.sampler.max_restarts}"),
              "task.reward_timeout_s": (cfg.task.reward_timeout_s >= 0,
                                        f">= 0 seconds (0: no limit, rewards in this process), got {cfg.task.reward_timeout_s}")})
    if not 0 <= r.seed < 2**63:
        raise ConfigError(f"run.seed must be in [0, 2**63), got {r.seed}")
    name = PurePath(r.name)
    if not r.name.strip() or name.is_absolute() or ".." in name.parts or name.parts in ((), (".",)) or "\0" in r.name:
        raise ConfigError(f"run.name={r.name!r} must be a relative name inside run.output_dir (no '..', not "
                          "absolute, not empty); put the directory in run.output_dir instead")
    if "\0" in r.output_dir or "\0" in r.init_checkpoint:
        raise ConfigError("run.output_dir and run.init_checkpoint must not contain NUL characters")
    if r.overwrite and r.resume:
        raise ConfigError("run.overwrite=true and run.resume=true contradict each other: resume continues the run "
                          "in the directory, overwrite moves it aside; pick one")


def _require(checks: dict[str, tuple[bool, str]]) -> None:
    """{key: (holds, what it must be)}: the first that does not hold is the error."""
    for key, (ok, must) in checks.items():
        if not ok:
            raise ConfigError(f"{key} must be {must}")


def validate_finite(cfg: Config) -> None:
    """No NaN or infinity in any number of the recipe (YAML reads .nan and .inf)."""
    _finite(cfg, "")


def _finite(values: Any, prefix: str) -> None:
    for f in dataclasses.fields(values):
        v = getattr(values, f.name)
        if dataclasses.is_dataclass(v):
            _finite(v, f"{prefix}{f.name}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{prefix}{f.name} must be a finite number, got {v}")


def validate_ranges(cfg: Config) -> None:
    """Ranges the sections' own checks do not cover."""
    m, s, rl, t, sft, lg = cfg.model, cfg.sampler, cfg.rl, cfg.task, cfg.sft, cfg.logging
    _require({
        "model.max_position_embeddings": (m.max_position_embeddings >= 1, f">= 1, got {m.max_position_embeddings}"),
        "model.ffn_hidden_size": (m.ffn_hidden_size >= 1, f">= 1, got {m.ffn_hidden_size}"),
        "model.norm_epsilon": (m.norm_epsilon > 0, f"> 0, got {m.norm_epsilon}"),
        "model.init_method_std": (m.init_method_std > 0, f"> 0, got {m.init_method_std}"),
        "model.rotary_base": (m.rotary_base > 0, f"> 0, got {m.rotary_base}"),
        "model.rotary_percent": (0 < m.rotary_percent <= 1, f"in (0, 1], got {m.rotary_percent}"),
        "model.moe_router_topk_scaling_factor": (m.moe_router_topk_scaling_factor > 0,
                                                 f"> 0, got {m.moe_router_topk_scaling_factor}"),
        "model.moe_aux_loss_coeff": (m.moe_aux_loss_coeff >= 0, f">= 0, got {m.moe_aux_loss_coeff}"),
        "model.moe_z_loss_coeff": (m.moe_z_loss_coeff >= 0, f">= 0, got {m.moe_z_loss_coeff}"),
        "model.moe_router_bias_update_rate": (m.moe_router_bias_update_rate >= 0,
                                              f">= 0, got {m.moe_router_bias_update_rate}"),
        "sampler.gpu_memory_utilization": (0 < s.gpu_memory_utilization <= 1,
                                           f"in (0, 1], got {s.gpu_memory_utilization}"),
        "sampler.vllm_kv_cache_gib": (s.vllm_kv_cache_gib >= 1, f">= 1, got {s.vllm_kv_cache_gib}"),
        "rl.overlong_max_len": (rl.overlong_max_len >= 0, f">= 0 (0 disables shaping), got {rl.overlong_max_len}"),
        "rl.overlong_cache": (rl.overlong_cache >= 0, f">= 0, got {rl.overlong_cache}"),
        "rl.kl_coef": (rl.kl_coef >= 0, f">= 0, got {rl.kl_coef}"),
        "task.min_digits": (t.min_digits >= 1, f">= 1, got {t.min_digits}"),
        "task.max_digits": (t.max_digits >= t.min_digits, f">= task.min_digits={t.min_digits}, got {t.max_digits}"),
        "sft.batch_size": (sft.batch_size >= 1, f">= 1, got {sft.batch_size}"),
        "sft.eval_problems": (sft.eval_problems >= 1, f">= 1, got {sft.eval_problems}"),
        "sft.target_reward": (0 <= sft.target_reward <= 1, f"in [0, 1] (0 disables early stopping), got "
                                                          f"{sft.target_reward}"),
        "logging.heatmap_every": (lg.heatmap_every >= 0, f">= 0 (0 disables it), got {lg.heatmap_every}"),
        "logging.rollouts_every": (lg.rollouts_every >= 0, f">= 0 (0 disables it), got {lg.rollouts_every}"),
        "run.eval_every": (cfg.run.eval_every >= 0, f">= 0 (0 disables it), got {cfg.run.eval_every}"),
        "run.eval_k": (cfg.run.eval_k >= 1, f">= 1, got {cfg.run.eval_k}"),
        "run.eval_max_problems": (cfg.run.eval_max_problems >= 0, f">= 0 (0: all), got {cfg.run.eval_max_problems}"),
        "parallel.logprob_chunk_tokens": (cfg.parallel.logprob_chunk_tokens >= 0,
                                          f">= 0 (0: full logits), got {cfg.parallel.logprob_chunk_tokens}"),
    })
    validate_task(t)


def validate_task(t: Any) -> None:
    """The task's text settings: reward spec, chat template, column names."""
    if t.reward != "math" and (t.reward.count(":") != 1 or not all(t.reward.split(":"))):
        raise ConfigError(f"task.reward={t.reward!r}: expected 'math' or a function 'module.path:function'")
    if t.chat_template not in ("auto", "none") and not t.chat_template.endswith(".jinja"):
        raise ConfigError(f"task.chat_template={t.chat_template!r}: expected auto, none or a .jinja file")
    for field, spec in [("task.environment", t.environment)] + [("task.tools", x) for x in t.tools]:
        if spec and (spec.count(":") != 1 or not all(spec.split(":"))):
            raise ConfigError(f"{field}={spec!r}: expected 'module.path:name'")
    for key in ("prompt_key", "messages_key", "answer_key", "metadata_key"):
        if not getattr(t, key):
            raise ConfigError(f"task.{key} must not be empty")


WANDB_FORBIDDEN = "/\\#?%:"
"""Characters W&B refuses in a project or entity name."""
WANDB_TAG_MAX = 64
"""W&B's longest tag."""


def validate_logging(cfg: Config) -> None:
    """The W&B names, checked here so that a bad one fails before the run starts, not at
    `wandb.init` after the model is built (whether wandb is installed is checked by the
    entry points: `moe_rl.runtime.wandb_log.require_wandb`)."""
    lg = cfg.logging
    for key in ("wandb_project", "wandb_entity"):
        value = getattr(lg, key)
        if any(c in WANDB_FORBIDDEN for c in value) or len(value) > 128:
            raise ConfigError(f"logging.{key}={value!r}: W&B names are at most 128 characters, without any of "
                              f"{' '.join(WANDB_FORBIDDEN)}")
    if not lg.wandb_project.strip():
        raise ConfigError("logging.wandb_project must not be empty (the W&B project to log to)")
    for tag in lg.wandb_tags:
        if not tag.strip() or len(tag) > WANDB_TAG_MAX:
            raise ConfigError(f"logging.wandb_tags: {tag!r} must be a non-empty tag of at most {WANDB_TAG_MAX} "
                              "characters")


SECTION_CHECKS = (validate_finite, validate_ranges, validate_model, validate_parallel, validate_rl, validate_sampler, validate_optimizer, validate_run,
                  validate_logging, validate_critic, validate_dpo, validate_reward_model)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need no process group. With `world_size`, the layout is checked too."""
    for check in SECTION_CHECKS:
        check(cfg)
    if world_size is not None:
        validate_layout(cfg, world_size)


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
