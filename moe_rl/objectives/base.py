"""The objective registry and the types an objective is written against.

An objective is a function `fn(ctx: Context, hp) -> Surrogate`: it reads the prepared,
masked tensors in `ctx`, forms its own ratio and surrogate, and returns the per-unit
objective u (per token [B,T] or per sequence [B]) plus what the metrics need. Everything
else (aggregation, normalizers, sampler correction, KL, metrics) is done once, by
`policy_loss`, from the `ObjectiveSpec` the function was registered with.

Hyperparameters are frozen dataclasses with an attribute docstring under each field (the
style of moe_rl/config): `CommonHParams` for what every objective shares (it extends the
config's `CorrectionHParams`, the rl.rollout_correction_args section), and one class per
objective family for its own. Registering an objective also registers its hyperparameter
class with the config package, so recipes accept rl.objective_args.<name>. `make_hparams`
builds them strictly: an unknown key is a ValueError naming it and the valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
from torch import Tensor

from moe_rl.config import CorrectionHParams, register_objective_hparams
from moe_rl.config.rl import ROLLOUT_CORRECTIONS
from moe_rl.objectives.batch import PolicyBatch
from moe_rl.objectives.common import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Aggregation,
    KLEstimator,
    RolloutCorrection,
    compute_dtype,
    masked_log_ratio,
)
from moe_rl.runtime.registry import Registry, build_hparams


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless `ok` (hyperparameter checks read as one line each)."""
    if not ok:
        raise ValueError(message)


def _is_count(x: object) -> bool:
    return isinstance(x, Tensor) or (isinstance(x, int | float) and not isinstance(x, bool) and x >= 0)


@dataclass(frozen=True)
class CommonHParams(CorrectionHParams):
    """Hyperparameters every objective accepts: sampler correction, KL penalty, normalizers
    (the correction's tis_cap / mis_low / mis_high come from `CorrectionHParams`)."""

    rollout_correction: RolloutCorrection = "none"
    """Sampler-learner correction from d = old_logprobs - rollout_logprobs: none | tis
    (weight min(exp(d), tis_cap)) | mis (reject tokens with exp(d) outside [mis_low,
    mis_high], the tis weight on the rest) | icepop (same rejection, weight 1) | is_rs (the
    general form: is_level, rs_level, rs_high, rs_low, veto_below, is_batch_normalize).
    Per sequence for gspo, gmpo, rspo (a rejected token rejects its sequence). The weight
    multiplies each unit's whole term, KL penalty included; rejected tokens leave the loss
    and its normalizers (`moe_rl.objectives.correction`)."""
    opsm_delta: float | None = None
    """Off-policy sequence masking: a sequence with A_i < 0 whose mean_t (rollout - logprobs)
    (current policy, detached) exceeds delta is masked out of the objective, its tokens kept
    in the normalizers. None: off. Needs rollout_logprobs and [B] advantages."""
    is_weight_mean: float | Tensor | None = None
    """is_batch_normalize: the step-wide mean of the importance weights over the kept units
    (every micro-batch and rank). None: this batch's own."""
    kl_coef: float = 0.0
    """Weight beta of the KL penalty to ref_logprobs (0: none). Aggregated like the objective
    (per-sequence token means for sequence-level objectives)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1."""
    token_normalizer: float | Tensor | None = None
    """Global number of valid (kept) tokens (token-mean objectives: dapo, cispo). None: this batch's."""
    seq_normalizer: float | Tensor | None = None
    """Global number of sequences with a valid (kept) token, B' (seq-mean and
    seq-mean-token-mean objectives). None: this batch's."""
    num_sequences_total: float | Tensor | None = None
    """Global number of sequences B, empty ones included (dr_grpo's 1/B). None: this batch's."""
    max_response_length: int | None = None
    """dr_grpo's constant L_max. None: this batch's T, which is only micro-batch invariant if
    every micro-batch is padded to the same T; pass the sampler's max_new_tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.rollout_correction in ROLLOUT_CORRECTIONS,
            f"rollout_correction={self.rollout_correction!r}; valid: {', '.join(ROLLOUT_CORRECTIONS)}",
        )
        self.check_mode(self.rollout_correction)
        require(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        require(
            self.kl_estimator in KL_ESTIMATORS,
            f"kl_estimator={self.kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}",
        )
        for name in ("token_normalizer", "seq_normalizer", "num_sequences_total", "is_weight_mean"):
            value = getattr(self, name)
            require(value is None or _is_count(value), f"{name} must be a count >= 0, got {value!r}")
        L = self.max_response_length
        require(
            L is None or (isinstance(L, int) and not isinstance(L, bool) and L >= 1),
            f"max_response_length must be an int >= 1, got {L!r}",
        )


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# --------------------------------------------------------------------------- what objectives see


class Context:
    """The prepared tensors an objective reads (built once per call by `policy_loss`).

    All are in the compute dtype (fp32 for bf16 inputs), masked to 0 on padding, and all but
    the log ratio / log-probabilities are detached."""

    def __init__(self, batch: PolicyBatch) -> None:
        self.mask_BT: Tensor = batch.response_mask
        self.dtype: torch.dtype = compute_dtype(batch.logprobs.dtype)
        self.mask_f_BT: Tensor = self.mask_BT.to(self.dtype)
        """The response mask as 0./1. floats (for weights; never multiplied into raw inputs)."""
        # One cast node: every gradient path sums in the compute dtype, then rounds once.
        self._logprobs = batch.logprobs.to(self.dtype)
        old_BT = batch.old_logprobs.detach().to(self.dtype)
        self.old_BT: Tensor = old_BT
        self.log_ratio_BT: Tensor = masked_log_ratio(self._logprobs, old_BT, self.mask_BT)
        """log(pi / pi_old) on valid tokens, 0 on padding, clamped to [-20, 20]; carries grad."""
        self.len_B: Tensor = self.mask_f_BT.sum(1)
        self.inv_len_B: Tensor = 1.0 / self.len_B.clamp(min=1)
        adv = batch.advantages.detach().to(self.dtype)
        self.adv_B: Tensor | None = adv if adv.ndim == 1 else None
        """Per-sequence advantages [B], or None when the batch carries [B,T] advantages."""
        self.adv_BT: Tensor = adv.unsqueeze(1) if adv.ndim == 1 else torch.where(self.mask_BT, adv, 0.0)
        """Advantages broadcastable to [B,T]: [B,1] for per-sequence, [B,T] (0 on padding)."""
        shift = batch.router_shift
        self.router_shift_BT: Tensor | None = None if shift is None else shift.detach().to(self.dtype)

    @cached_property
    def nonempty_B(self) -> Tensor:
        """[B] bool: the sequences with a valid token."""
        return self.len_B > 0

    @cached_property
    def num_nonempty(self) -> Tensor:
        """How many sequences have a valid token (int64 scalar; computed once per call)."""
        return self.nonempty_B.sum()

    @cached_property
    def logprobs_BT(self) -> Tensor:
        """Current log-probabilities on valid tokens, 0 on padding; carries grad."""
        return torch.where(self.mask_BT, self._logprobs, 0.0)


@dataclass
class Surrogate:
    """What an objective returns."""

    objective: Tensor
    """u, to be maximised: [B,T] per token (token-level) or [B] per sequence (sequence-level).
    Finite everywhere (padding included); the aggregation weights zero what does not count."""
    ratio: Tensor
    """Detached ratio the `ratio_*` metrics report: per token [B,T] or per sequence [B]."""
    clipped: Tensor
    """Bool mask of units whose clip is active, [B,T] or [B] (for `clip_frac`)."""


@dataclass(frozen=True)
class ObjectiveSpec:
    """A registry entry: the surrogate function and everything `policy_loss` needs around it."""

    name: str
    """Registry name (what RLConfig.objective holds)."""
    fn: Callable[[Context, Any], Surrogate]
    """The objective's own ratio and surrogate."""
    hparams: type
    """Frozen dataclass type of the objective's own hyperparameters (defaults + docstrings)."""
    aggregation: Aggregation
    """One of common.AGGREGATIONS; `seq-mean` makes the objective sequence-level."""
    paper: str
    """Citation of the paper that defines it."""
    fixes: str
    """The one thing it fixes, in a sentence."""
    needs_router_shift: bool = False
    """True when PolicyBatch.router_shift is required (rspo)."""

    @property
    def level(self) -> Literal["token", "sequence"]:
        """Unit of ratios, clipping and metric means: 'sequence' for seq-mean objectives."""
        return "sequence" if self.aggregation == "seq-mean" else "token"


OBJECTIVES: Registry[ObjectiveSpec] = Registry("objective")


def register_objective(
    name: str,
    *,
    hparams: type,
    aggregation: Aggregation,
    paper: str,
    fixes: str,
    needs_router_shift: bool = False,
) -> Callable[[Callable[[Context, Any], Surrogate]], Callable[[Context, Any], Surrogate]]:
    """Decorator: register `fn` as objective `name` (a duplicate name raises ValueError)."""
    require(aggregation in AGGREGATIONS, f"{name}: unknown aggregation {aggregation!r}")
    require(
        dataclasses.is_dataclass(hparams) and hparams.__dataclass_params__.frozen,  # type: ignore[attr-defined]
        f"{name}: hparams must be a frozen dataclass type",
    )
    clash = set(field_names(hparams)) & set(field_names(CommonHParams))
    require(not clash, f"{name}: hyperparameters {sorted(clash)} clash with CommonHParams")

    def deco(fn: Callable[[Context, Any], Surrogate]) -> Callable[[Context, Any], Surrogate]:
        OBJECTIVES.register(
            name, ObjectiveSpec(name, fn, hparams, aggregation, paper, fixes, needs_router_shift)
        )
        # recipes then accept rl.objective=<name> and rl.objective_args.<name>.*
        register_objective_hparams(name, hparams, summary=fixes, needs_router_shift=needs_router_shift,
                                   sequence_level=aggregation == "seq-mean")
        return fn

    return deco


def make_hparams(name: str, **kwargs: Any) -> Any:
    """The objective's own hyperparameters (e.g. from RLConfig.objective_args), strictly:
    an unknown objective or key raises ValueError listing the valid ones."""
    return build_hparams(OBJECTIVES[name].hparams, kwargs, f"objective {name!r}")


def make_common_hparams(**kwargs: Any) -> CommonHParams:
    """The shared hyperparameters (correction, KL, normalizers), strictly."""
    return build_hparams(CommonHParams, kwargs, "all objectives (CommonHParams)")


def split_hparams(name: str, hparams: Mapping[str, Any]) -> tuple[CommonHParams, Any]:
    """Split `policy_loss` keyword arguments into (CommonHParams, the objective's own)."""
    spec = OBJECTIVES[name]
    own_keys, common_keys = field_names(spec.hparams), field_names(CommonHParams)
    unknown = [k for k in hparams if k not in own_keys and k not in common_keys]
    if unknown:
        raise ValueError(
            f"unknown hyperparameter {unknown[0]!r} for objective {name!r}; valid: "
            f"{', '.join(own_keys) or '(none of its own)'}; shared: {', '.join(common_keys)}"
        )
    common = CommonHParams(**{k: v for k, v in hparams.items() if k in common_keys})
    own = spec.hparams(**{k: v for k, v in hparams.items() if k in own_keys})
    return common, own
