"""What the rest of moe_rl may use of a learner: the `PolicyLearner` protocol.

    if TYPE_CHECKING:
        from moe_rl.learner.protocols import PolicyLearner
    def push(self, learner: PolicyLearner, version: int) -> dict[str, float]: ...

The programs, their step components, the update phase and the weight sync take a
`PolicyLearner`, not the megatron-core `Learner` class, so that they name the calls they
make and nothing more; `Learner` (and the critic built on it) satisfies it, which the type
checker verifies where one is handed over. Import it under `TYPE_CHECKING` outside
`moe_rl/learner/`: the package's `__init__` imports megatron.core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from moe_rl.batch import TokenBatch
    from moe_rl.config import ModelConfig
    from moe_rl.learner.microbatch import LossFn, ScoreResult, UpdateResult
    from moe_rl.learner.parallel import Layout
    from moe_rl.learner.routing.taps import RoutingPlan
    from moe_rl.routing.record import RoutingRecord
    from moe_rl.step_batch import StepBatch

T = TypeVar("T")


class PolicyLearner(Protocol):
    """A model's shard on this rank, scored and (when it has an optimizer) trained in
    micro-batches; every method is collective over the learner ranks."""

    layout: Layout
    """Where this rank sits in the model-parallel layout."""
    model_cfg: ModelConfig
    """The model section it was built from."""
    gpt: torch.nn.Module
    """This rank's shard of the model, unwrapped (what the weight export reads)."""
    step: int
    """Optimizer updates applied so far."""

    def score(self, batch: StepBatch, plan: RoutingPlan | None = None, temperature: float = 1.0) -> ScoreResult:
        """Log-probs (and, per `plan`, the routing record) of this rank's rows."""
        ...

    def update(self, batch: StepBatch, loss_fn: LossFn, plan: RoutingPlan | None = None,
               temperature: float = 1.0) -> UpdateResult:
        """One optimizer update on this rank's rows of a mini-batch."""
        ...

    def routing_plan(self, replay: str, batch: StepBatch, *, capture: bool = False) -> RoutingPlan:
        """What the routers do in a pass over `batch` under replay mode `replay`."""
        ...

    def sampler_disagreement(self, record: RoutingRecord, batch: StepBatch) -> dict[str, float]:
        """Per-layer fraction of scored positions where the sampler's top-k set differs."""
        ...

    def score_whole(self, tokens: TokenBatch, temperature: float = 1.0,
                    routing: RoutingPlan | None = None) -> ScoreResult:
        """`score` of a whole batch, [B, T] on every rank."""
        ...

    def logprobs(self, tokens: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T] log-probs of a whole batch's response tokens, on every rank."""
        ...

    def train_step(self, tokens: TokenBatch, loss_fn: LossFn, extras: dict[str, torch.Tensor] | None = None,
                   temperature: float = 1.0, routing: RoutingPlan | None = None) -> dict[str, float]:
        """`update` on a whole batch; its metrics."""
        ...

    def all_gather_object(self, obj: T, group: ProcessGroup | None = None) -> list[T]:
        """Every rank's `obj` in `group` (default: every learner rank), in rank order."""
        ...

    def dp_gather_object(self, obj: T) -> list[T]:
        """Every data-parallel rank's `obj`, in data-parallel rank order."""
        ...
