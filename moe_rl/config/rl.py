"""The `rl` section: objective, advantages, replay and corrections, with each objective's
hyperparameters typed at load time.

    rl:
      objective: rspo
      objective_args:
        rspo: {gamma_min: 0.1}      # only rspo reads this block
        gspo: {clip_low: 3.0e-4}    # ... and only gspo this one

`ObjectiveArgs` holds one hyperparameter dataclass per registered objective (defaults plus
what the recipe sets), built when the config is loaded, so a typo fails there, naming the
objective and its valid keys, and `rl.objective=gspo` on a recipe written for rspo just works.
The objectives register their dataclasses (`objective_hparams`); this module imports none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from moe_rl.config.advantage_kinds import ADVANTAGE_KINDS
from moe_rl.config.coerce import build_section, choices_hint, key_text
from moe_rl.config.errors import ConfigError, require_all, require_positive
from moe_rl.config.objective_hparams import OBJECTIVE_HPARAMS


class ObjectiveArgs(Mapping[str, Any]):
    """{objective name: its hyperparameter dataclass} for every registered objective
    (a `ConfigValue`: the coercer builds it with `from_config`)."""

    def __init__(self, data: Mapping[str, Any] | None = None, key: str = "rl.objective_args") -> None:
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{key}: expected a mapping of objective name -> hyperparameters, got {data!r}")
        for name in data:
            if name not in OBJECTIVE_HPARAMS:
                raise ConfigError(_not_an_objective(key, str(name)))
        self._by_name: dict[str, Any] = {}
        for name, entry in OBJECTIVE_HPARAMS.items():
            block = data.get(name)
            self._by_name[name] = build_section(entry.hparams, {} if block is None else block,
                                                f"{key}.{name}.", what=f"objective {name}")

    @classmethod
    def from_config(cls, value: Any, key: str) -> ObjectiveArgs:
        return cls(value, key)

    def to_config(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(hp) for name, hp in self._by_name.items()}

    @classmethod
    def config_sections(cls) -> list[tuple[str, str, type]]:
        return [(name, entry.summary, entry.hparams) for name, entry in OBJECTIVE_HPARAMS.items()]

    def __getitem__(self, name: str) -> Any:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectiveArgs) and self._by_name == other._by_name

    def __hash__(self) -> int:
        return hash(tuple(self._by_name.items()))

    def __repr__(self) -> str:
        return f"ObjectiveArgs({self._by_name!r})"


def _not_an_objective(key: str, name: str) -> str:
    owners = [n for n, e in OBJECTIVE_HPARAMS.items() if name in {f.name for f in dataclasses.fields(e.hparams)}]
    if owners:
        return (f"{key}.{name}: not an objective; hyperparameters go under their objective's name, "
                f"e.g. {key}.{owners[0]}.{name}=...; valid: {', '.join(OBJECTIVE_HPARAMS)}")
    return f"{key}.{key_text(name)}: not an objective{choices_hint(name, OBJECTIVE_HPARAMS)}"


CORRECTION_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")
"""Where an importance weight or a rejection is decided: per token (r_t = exp(d_t)), per
sequence on the product exp(sum_t d_t), or per sequence on the geometric mean exp(mean_t d_t)."""
CorrectionLevel = Literal["none", "token", "sequence", "geometric"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "icepop", "is_rs")
"""rl.rollout_correction's names: three presets and the general importance-weight/rejection form."""
IS_RS_KEYS = ("is_level", "rs_level", "rs_high", "rs_low", "veto_below", "is_batch_normalize")
"""The keys only `is_rs` reads (the presets fix them: `CorrectionHParams.check_mode`)."""


@dataclass(frozen=True)
class CorrectionHParams:
    """The knobs of the sampler-learner correction (what `rl.rollout_correction_args` sets;
    the objectives' CommonHParams extends it). d_t = old_t - rollout_t (learner over sampler)
    on response tokens, r_t = exp(d_t). Formulas and advice: docs/rollout_correction.md."""

    tis_cap: float = 2.0
    """TIS truncation C, the importance-weight cap: a weight is min(ratio, C) (tis; mis on kept
    tokens; is_rs)."""
    mis_low: float = 0.5
    """mis / icepop: tokens whose r_t is below this are rejected (out of the loss and its counts)."""
    mis_high: float = 2.0
    """mis / icepop: tokens whose r_t is above this are rejected."""
    is_level: CorrectionLevel = "none"
    """is_rs: the importance weight, min(r_t, C) per token (token), min(exp(sum_t d_t), C) per
    sequence (sequence), min(exp(mean_t d_t), C) per sequence (geometric), or none (weight 1).
    Sequence-level objectives (gspo, gmpo, rspo) take sequence or geometric only."""
    rs_level: CorrectionLevel = "none"
    """is_rs: rejection: a token whose r_t (token), or a sequence whose exp(sum_t d_t)
    (sequence) or exp(mean_t d_t) (geometric), lies outside [rs_low, rs_high] is rejected
    (a rejected token of a sequence-level objective rejects its sequence)."""
    rs_high: float | None = None
    """is_rs: the rejection band's upper bound, required with rs_level (a sequence product needs
    a far wider band than a token ratio or a geometric mean)."""
    rs_low: float | None = None
    """is_rs: the rejection band's lower bound; None: 1 / rs_high."""
    veto_below: float | None = None
    """is_rs: reject a whole sequence if any of its tokens has r_t below this (a token the
    sampler found far likelier than the learner does); None: off."""
    is_batch_normalize: bool = False
    """is_rs: divide the importance weights by their mean over the step's kept tokens (token
    level) or kept sequences (sequence levels), over every data-parallel rank."""

    def __post_init__(self) -> None:
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got mis_low={self.mis_low}, mis_high={self.mis_high}")
        for key in ("is_level", "rs_level"):
            if getattr(self, key) not in CORRECTION_LEVELS:
                raise ValueError(f"{key}={getattr(self, key)!r}; valid: {', '.join(CORRECTION_LEVELS)}")
        if self.rs_level != "none" and self.rs_high is None:
            raise ValueError(f"rs_level={self.rs_level} needs rs_high (the band's upper bound; its scale differs "
                             "by orders of magnitude between levels)")
        if self.rs_level == "none" and (self.rs_high is not None or self.rs_low is not None):
            raise ValueError("rs_high and rs_low are read only with rs_level (token, sequence or geometric)")
        if self.rs_high is not None and not self.rs_high > 0:
            raise ValueError(f"rs_high must be > 0, got {self.rs_high}")
        if self.rs_high is not None and not 0 <= self.band[0] < self.band[1]:
            raise ValueError(f"need 0 <= rs_low < rs_high, got rs_low={self.rs_low}, rs_high={self.rs_high}")
        if self.veto_below is not None and not 0 < self.veto_below < 1:
            raise ValueError(f"veto_below must be in (0, 1) (a ratio r_t below it vetoes), got {self.veto_below}")

    @property
    def band(self) -> tuple[float, float]:
        """The is_rs rejection band [rs_low, rs_high] (rs_low defaults to 1 / rs_high)."""
        high = float(self.rs_high) if self.rs_high is not None else math.inf
        low = self.rs_low if self.rs_low is not None else (1.0 / high if self.rs_high is not None else 0.0)
        return float(low), high

    def check_mode(self, mode: str) -> None:
        """ValueError when `mode` (rl.rollout_correction) is unknown, or these knobs set what
        it does not read: the presets fix the is_rs keys, and is_rs with none of them set
        would do nothing."""
        if mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction={mode!r}; valid: {', '.join(ROLLOUT_CORRECTIONS)}")
        defaults = CorrectionHParams()
        changed = [k for k in IS_RS_KEYS if getattr(self, k) != getattr(defaults, k)]
        if mode != "is_rs" and changed:
            raise ValueError(f"{changed[0]} is read only by rollout_correction=is_rs (got {mode}); set "
                             f"rl.rollout_correction=is_rs, or leave {changed[0]} unset")
        if mode == "is_rs" and self.is_level == "none" and self.rs_level == "none" and self.veto_below is None:
            raise ValueError("rollout_correction=is_rs with is_level, rs_level and veto_below all unset does "
                             "nothing: set at least one (e.g. is_level=token)")
        if self.is_batch_normalize and mode == "is_rs" and self.is_level == "none":
            raise ValueError("is_batch_normalize needs is_level (there is no importance weight to normalize)")


@dataclass(frozen=True)
class RLConfig:
    """The policy-gradient step: objective, advantages, replay, corrections."""

    objective: str = "rspo"
    """Policy loss name: one of the objectives moe_rl.objectives registers (grpo, gspo, rspo, ...)."""
    objective_args: ObjectiveArgs = field(default_factory=ObjectiveArgs)
    """Each objective's own hyperparameters, under its name: {rspo: {gamma_min: 0.2},
    gspo: {clip_low: 3e-4}}. Every objective keeps its own block, so switching
    rl.objective needs no clearing; keys are checked against each objective's dataclass."""
    advantage: str = "grpo"
    """Advantage estimator: a group estimator from moe_rl.advantages (grpo, dr_grpo, rloo,
    batch_std), or gae: PPO's per-token advantages from a learned critic (the `critic`
    section; moe_rl.programs.ppo.critic_stage, moe_rl.programs.ppo.gae): an estimator registered as needing a critic."""
    gae_gamma: float = 1.0
    """GAE's discount gamma over response tokens (rl.advantage=gae)."""
    gae_lambda: float = 0.95
    """GAE's lambda: 1 gives Monte-Carlo returns minus values, 0 the one-step TD error."""
    whiten_advantages: bool = True
    """rl.advantage=gae: whiten the token advantages over the step's batch (mean 0, std 1
    over every valid token of every data-parallel rank)."""
    kl_in_reward: bool = False
    """rl.advantage=gae: put the KL to the reference in the per-token reward, -kl_coef * k1
    (k1 = log pi_old - log pi_ref, as the design documents write it; rl.kl_estimator is the
    loss's penalty and is not read then), instead of in the loss."""
    kl_target: float = 0.0
    """rl.kl_in_reward: PPO's adaptive KL controller (Ziegler et al. 2019): after each step
    the reward's KL weight (starting at rl.kl_coef) is multiplied by
    1 + clip(KL / kl_target - 1, -0.2, 0.2) * B / kl_horizon, KL being the step's mean over
    its B responses of each one's summed k1 (nats per response). 0: a fixed weight."""
    kl_horizon: int = 10000
    """The adaptive KL controller's horizon, in responses (rl.kl_target > 0)."""
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
    rollout_correction: Literal["none", "tis", "mis", "icepop", "is_rs"] = "none"
    """Sampler-learner correction from d = old_logprobs - rollout_logprobs: none; the presets
    tis (weight min(r_t, tis_cap)), mis (tis's weight, tokens with r_t outside [mis_low,
    mis_high] rejected), icepop (the same rejection, weight 1); or is_rs, the general form
    (importance weights and rejection at token, sequence or geometric level, a veto, batch
    normalization: rl.rollout_correction_args). Rejected tokens leave the loss and its
    normalizers. docs/rollout_correction.md."""
    rollout_correction_args: CorrectionHParams = field(default_factory=CorrectionHParams)
    """Correction hyperparameters: tis_cap, mis_low, mis_high (the presets) and is_level,
    rs_level, rs_high, rs_low, veto_below, is_batch_normalize (is_rs)."""
    opsm_delta: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): at each update, a negative-advantage
    sequence whose mean_t (rollout_t - logp_t) under the current policy exceeds delta is
    masked out of the objective (its tokens stay in the normalizers). None: off; 0 is a
    valid, aggressive threshold. Per-sequence advantages only."""
    old_logprobs: Literal["learner", "sampler"] = "learner"
    """The behaviour policy's log-probs: learner (the learner rescored the batch: the scoring
    pass) or sampler (bypass: the sampler's own log-probs are the old policy and the scoring
    pass is skipped; refused where that pass is needed anyway: R2, rspo, a correction from d)."""
    max_staleness: int = 0
    """Asynchronous rollout: the engines sample ahead while the learner trains, and no row
    trains under a policy more than this many weight pushes (k) newer than its oldest token.
    Without segmented decoding (below) the engines keep a queue of k batches: batch n + k is
    sampled with step n-1's weights while step n trains (a fixed schedule, reproducible
    whatever the timing; k = 1 is one-step-off). With it, the engines run one batch ahead
    and k bounds the tokens partial rollouts carry over: a group with an older token is
    dropped and counted (rollout/dropped_stale). Needs sampler.placement=separate and a
    rollout_correction. 0: the synchronous loop."""
    inflight_weight_updates: bool = False
    """Segmented decoding (`moe_rl.rollout.segmented`): the engines take the learner's
    weights between two decoding segments instead of at a batch boundary; a response then
    holds tokens of several versions, each with its own behaviour log-prob and routes. The
    running responses' KV is recomputed under the new weights (the prefix cache is reset at
    every update). Needs rl.max_staleness >= 1."""
    partial_rollouts: bool = False
    """Segmented decoding: a step trains on the first prompts_per_step groups to finish (a
    group trains whole); unfinished responses continue into later steps instead of being
    waited for. Needs rl.max_staleness >= 1."""
    partial_oversample: float = 0.5
    """rl.partial_rollouts: spare groups the engines keep decoding, as a fraction of
    prompts_per_step (further draws of the step's problems): the batch takes the first
    prompts_per_step to finish, the rest carry over."""
    async_schedule: Literal["deterministic", "throughput"] = "deterministic"
    """Where in-flight updates pause the engine: `deterministic` after exactly
    rl.inflight_push_after_segments segments of the next batch (the same seed gives the same
    rewards: tests, papers); `throughput` at the first pause point after the learner's push
    has begun to arrive (the engine never waits for the learner mid-batch)."""
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """What an in-flight update does to the running responses' KV: `recompute` (segmented
    decoding: each segment re-feeds the response under the weights of the moment) or `keep`
    (vLLM's asynchronous engine decodes continuously and is paused with its requests and
    their KV kept, `pause_generation(mode="keep", clear_cache=False)`, as PipelineRL does:
    `moe_rl.sampler.vllm_stream`). keep needs sampler.backend=vllm and
    rl.async_schedule=throughput (it pauses when the push arrives, not at token counts)."""
    inflight_segment_tokens: int = 32
    """Segmented decoding: tokens decoded per response between two pause points."""
    inflight_push_after_segments: int = 1
    """rl.async_schedule=deterministic: segments of the next batch decoded under the old
    weights before the engine takes the new ones (0: at once, the synchronous policy)."""
    max_turns: int = 1
    """Assistant turns per episode. 1: one prompt, one response (no environment). More: a
    multi-turn episode (`moe_rl.rollout.episodes`): after each turn the task's environment
    answers (tool results, a user turn) and the policy goes on, until the environment says
    it is done or a limit is reached; sampler.max_new_tokens is then the whole episode's
    budget after the prompt (turns and observations), the row's width. Needs a chat template."""
    max_turn_tokens: int = 0
    """Multi-turn: tokens one assistant turn may take (0: what is left of the episode's
    budget). A turn cut at a limit ends its episode (scored as it is, counted in
    rollout/truncated_frac)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; >0 keeps a reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator used for the penalty in the loss (with rl.kl_in_reward the reward's is k1)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts. Under segmented
    decoding each group is screened as it finishes and a new problem's group takes its
    place (`moe_rl.rollout.segmented`)."""
    max_draws: int = 3
    """With dynamic sampling: at most this many prompt batches are drawn per step. When they
    hold fewer groups with signal than prompts_per_step, the step trains on those it has: a
    step with fewer rows than its mini-batches need makes fewer updates (`policy/updates`;
    the log says so the first time)."""
    overlong_max_len: int = 0
    """DAPO overlong shaping L_max in tokens; 0 disables shaping."""
    overlong_cache: int = 0
    """DAPO overlong shaping cache L_c in tokens."""
    on_policy_shortcut: bool = True
    """With one update per rollout and no replay, skip the old-logprob pass: the update's own
    forward runs at the same weights, so its logprobs (and routing record) are the old ones."""
    capture_routing: bool = True
    """Record per-layer top-k ids and log routing probabilities in the old-logprob pass
    (needed by rspo and the routing statistics)."""

    @property
    def multi_turn(self) -> bool:
        """Episodes of several turns with an environment (`moe_rl.rollout.episodes`)."""
        return self.max_turns > 1

    @property
    def segmented(self) -> bool:
        """The engines decode in segments (`moe_rl.rollout.segmented`)."""
        return self.inflight_weight_updates or self.partial_rollouts

    @property
    def hparams(self) -> Any:
        """The chosen objective's hyperparameters (its frozen dataclass)."""
        return self.objective_args[self.objective]

    @property
    def records_routing(self) -> bool:
        """The learner records routing in the scoring pass: asked for, needed by a replay
        mode, or needed by the objective's router shift."""
        return (self.capture_routing or self.replay != "none"
                or OBJECTIVE_HPARAMS[self.objective].needs_router_shift)

    @property
    def scores_in_update(self) -> bool:
        """The on-policy shortcut applies: one update per rollout, no routing replay, and no
        KL in a critic's reward (that needs the old logprobs before the update)."""
        return (self.on_policy_shortcut and self.epochs * self.num_minibatches == 1 and self.replay == "none"
                and not self.kl_in_reward)

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator needs a learned critic (the registry says so: PPO's GAE);
        False for a name nobody registered (the preflight refuses it)."""
        return self.advantage in ADVANTAGE_KINDS and ADVANTAGE_KINDS[self.advantage].needs_critic


    def validate(self) -> None:
        """The section's own rules (ConfigError naming the key); those against the sampler,
        the task, the model or the optimizer are `moe_rl.config.cross_section`'s."""
        rl = self
        require_positive({"rl.group_size": rl.group_size, "rl.prompts_per_step": rl.prompts_per_step,
                          "rl.num_minibatches": rl.num_minibatches, "rl.epochs": rl.epochs})
        if rl.objective not in OBJECTIVE_HPARAMS:
            raise ConfigError(f"rl.objective={rl.objective!r} is unknown{choices_hint(rl.objective, OBJECTIVE_HPARAMS)}")
        if OBJECTIVE_HPARAMS[rl.objective].needs_router_shift and not rl.capture_routing:
            raise ConfigError(f"rl.objective={rl.objective} needs rl.capture_routing=true (router shift)")
        if rl.dynamic_sampling and rl.max_draws < 1:
            raise ConfigError("rl.max_draws must be >= 1 with rl.dynamic_sampling")
        if rl.overlong_max_len and not 0 <= rl.overlong_cache < rl.overlong_max_len:
            raise ConfigError("rl.overlong_cache must be in [0, rl.overlong_max_len)")
        require_all({
            "rl.overlong_max_len": (rl.overlong_max_len >= 0, f">= 0 (0 disables shaping), got {rl.overlong_max_len}"),
            "rl.overlong_cache": (rl.overlong_cache >= 0, f">= 0, got {rl.overlong_cache}"),
            "rl.kl_coef": (rl.kl_coef >= 0, f">= 0, got {rl.kl_coef}"),
        })
        if rl.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness must be >= 0 (0: synchronous), got {rl.max_staleness}")
        if rl.segmented:
            self._validate_segmented()
        if rl.max_turns < 1 or rl.max_turn_tokens < 0:
            raise ConfigError(f"rl.max_turns must be >= 1 and rl.max_turn_tokens >= 0, got {rl.max_turns} and "
                              f"{rl.max_turn_tokens}")
        if rl.multi_turn and rl.uses_critic:
            raise ConfigError(f"rl.max_turns={rl.max_turns} is not implemented with rl.advantage={rl.advantage} (a "
                              "critic's values over observation tokens are undefined here); use a group estimator")
        if rl.max_staleness and rl.rollout_correction == "none" and rl.old_logprobs == "learner":
            raise ConfigError(f"rl.max_staleness={rl.max_staleness} trains on batches sampled by an older policy: set "
                              "rl.rollout_correction (tis, mis, icepop or is_rs) to correct for the sampler-learner "
                              "gap, or rl.old_logprobs=sampler")
        self._validate_correction()
        self._validate_critic_settings()

    def _validate_segmented(self) -> None:
        rl = self
        which = "rl.inflight_weight_updates" if rl.inflight_weight_updates else "rl.partial_rollouts"
        if rl.max_staleness < 1:
            raise ConfigError(f"{which}=true needs rl.max_staleness >= 1 (the engines run ahead of the learner) and "
                              "sampler.placement=separate")
        require_all({
            "rl.inflight_segment_tokens": (rl.inflight_segment_tokens >= 1, f">= 1, got {rl.inflight_segment_tokens}"),
            "rl.inflight_push_after_segments": (rl.inflight_push_after_segments >= 0,
                                                f">= 0, got {rl.inflight_push_after_segments}"),
            "rl.partial_oversample": (rl.partial_oversample >= 0, f">= 0, got {rl.partial_oversample}"),
        })
        if rl.async_schedule not in ("deterministic", "throughput"):
            raise ConfigError(f"rl.async_schedule={rl.async_schedule!r}: choose deterministic or throughput")
        if rl.inflight_kv == "keep" and rl.async_schedule != "throughput":
            raise ConfigError("rl.inflight_kv=keep pauses the engine when the learner's push arrives, which is not a "
                              "fixed token count: set rl.async_schedule=throughput (or rl.inflight_kv=recompute for "
                              "the deterministic schedule)")
        if rl.inflight_kv == "keep" and rl.multi_turn:
            raise ConfigError(f"rl.max_turns={rl.max_turns}: multi-turn episodes decode in segments for now; set "
                              "rl.inflight_kv=recompute")

    def _validate_correction(self) -> None:
        """The rollout correction's knobs against its mode, OPSM and the bypass mode."""
        rl = self
        try:
            rl.rollout_correction_args.check_mode(rl.rollout_correction)
        except ValueError as e:
            raise ConfigError(f"rl.rollout_correction_args: {e}") from None
        if OBJECTIVE_HPARAMS[rl.objective].sequence_level and rl.rollout_correction_args.is_level == "token":
            raise ConfigError(f"rl.rollout_correction_args.is_level=token: rl.objective={rl.objective} is "
                              "sequence-level (one ratio per sequence); use is_level=sequence or geometric")
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

    def _validate_critic_settings(self) -> None:
        """PPO's settings of this section: GAE, the KL in the reward and its controller."""
        rl = self
        if not 0 <= rl.gae_gamma <= 1 or not 0 <= rl.gae_lambda <= 1:
            raise ConfigError(f"rl.gae_gamma and rl.gae_lambda must be in [0, 1], got {rl.gae_gamma} and "
                              f"{rl.gae_lambda}")
        if rl.kl_target < 0 or rl.kl_horizon < 1:
            raise ConfigError(f"rl.kl_target must be >= 0 and rl.kl_horizon >= 1, got {rl.kl_target} and "
                              f"{rl.kl_horizon}")
        if rl.kl_target > 0 and not rl.kl_in_reward:
            raise ConfigError("rl.kl_target adapts the weight of the KL in GAE's per-token reward: it needs "
                              "rl.kl_in_reward=true (the KL penalty in the loss keeps rl.kl_coef)")
        if not rl.uses_critic:
            if rl.kl_in_reward:
                raise ConfigError("rl.kl_in_reward puts the KL penalty in GAE's per-token reward: it needs "
                                  "rl.advantage=gae (with group advantages the penalty goes in the loss: rl.kl_coef)")
            return
        if rl.kl_in_reward and rl.kl_coef <= 0:
            raise ConfigError("rl.kl_in_reward=true needs rl.kl_coef > 0 (the weight of the per-token k1 in the reward)")
        if rl.dynamic_sampling:
            raise ConfigError("rl.dynamic_sampling drops groups with equal rewards, a GRPO-family fix for zero group "
                              "advantages; with rl.advantage=gae every row has a signal: set rl.dynamic_sampling=false")
