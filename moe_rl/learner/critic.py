"""PPO's critic: the actor's megatron-core architecture at the actor's layout, with a
scalar value head in place of the output layer.

    critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=n)
    values_bT = critic.values(batch)                          # [b, T], no gradients
    result = critic.update(batch, ValueLossFn(cfg.critic), plan=None)   # one Adam step of its own

Model. `ValueModel` (and so `Critic`) is a `Learner` whose last stage, instead of log-probs, maps the final
hidden state at each response token's scoring slot (the slot whose logits would score that
token: the state before the token is generated) through `ValueHead`, h . w + b, both zero
at the start (so the first values are 0). The output layer is still built by `GPTModel` but
frozen and bypassed: no gradient, no optimizer state, never read; the value head is a
parameter of the module DDP wraps (the optimizer, the grad buffer and `dist_checkpointing`
see it), on the last pipeline stage only, replicated over TP: every TP rank computes the
whole value from the gathered hidden states, so its gradient needs no TP reduction.

`ValueModel` is that learner, built like any learner from the model, parallel and
optimizer sections it is given: the reward model of `moe_rl.reward_model` is one with the
run's `optimizer` section; `Critic` is PPO's, given the `critic.optimizer` section (of the
actor's `optimizer` type). Everything else is the learner's: micro-batching, packing, the
pipeline schedule, its own megatron optimizer. Its MoE routers route on their own (the
trainer passes no routing plan). It is never converted for the sampler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moe_rl.learner.engine import Learner
from moe_rl.learner.microbatch import MicroBatch
from moe_rl.learner.output_head import whole_sequence
from moe_rl.step_batch import StepBatch

VALUE_HEAD = "value_head"
"""The value head's module name in the critic's GPTModel."""
VALUE_HEAD_KEYS = VALUE_HEAD + "."
"""The prefix of its parameter names: what no policy checkpoint holds (`optional=` of the loaders)."""


class ValueHead(torch.nn.Module):
    """V(h) = h . w + b for final hidden states h, computed in fp32; zero-initialised."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        return hidden_NH.float() @ self.weight.float() + self.bias.float()


class _ValueOutput:
    """The critic's head: the output layer's forward passes the (gathered) hidden states
    through, and `values` reads the value of every response token's scoring slot."""

    chunk_tokens = 0  # (no entropy: the learner asks for it only of a chunked log-prob head)

    def __init__(self, gpt: torch.nn.Module, sequence_parallel: bool) -> None:
        self.gpt = gpt
        layer = getattr(gpt, "output_layer", None)
        if layer is not None:  # (the last pipeline stage)
            layer.forward = lambda h, weight=None, **kw: (whole_sequence(h, sequence_parallel), None)

    @contextlib.contextmanager
    def learner_pass(self) -> Iterator[None]:
        yield

    def values(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[b, T] fp32 values at the response tokens (0 elsewhere); differentiable."""
        flat_NH = output.reshape(-1, output.shape[-1])
        mask_BT = mb.batch.response_mask().to(flat_NH.device, non_blocking=True)
        assert mb.inp is not None  # (set by the learner before the forward)
        index_BT = mb.inp.logit_index_BT.to(flat_NH.device, non_blocking=True)
        # the head on every [b, T] slot, then zeros off the responses: selecting the response
        # slots first (a boolean index) would read their count back from the device
        values_BT = getattr(self.gpt, VALUE_HEAD)(flat_NH[index_BT.reshape(-1)]).view(index_BT.shape)
        return torch.where(mask_BT, values_BT, values_BT.new_zeros(()))


class ValueModel(Learner):
    """A value model (this rank's shard), its optimizer and schedule: built as a `Learner`,
    from the model, parallel and optimizer sections it is given. The reward model's learner
    (`moe_rl.reward_model`) is one; PPO's critic is one with the critic's own optimizer."""

    def _prepare_model(self, gpt: torch.nn.Module) -> None:
        layer = getattr(gpt, "output_layer", None)
        if layer is None:
            return
        if layer.weight is not None and not gpt.share_embeddings_and_output_weights:
            layer.weight.requires_grad_(False)  # bypassed: no gradient, no optimizer state
        ref = next(p for p in gpt.parameters() if p.requires_grad)
        gpt.add_module(VALUE_HEAD, ValueHead(self.model_cfg.hidden_size, ref.dtype, ref.device))

    def _make_head(self) -> _ValueOutput:
        return _ValueOutput(self.gpt, self.layout.sequence_parallel)

    def _token_outputs(self, output: torch.Tensor, mb: MicroBatch,
                       temperature: float) -> tuple[torch.Tensor, None]:
        return self.head.values(output, mb), None

    def init_value_head(self, std: float, seed: int) -> None:
        """Value head weights ~ N(0, std^2) from a generator seeded with `seed` (the same on
        every rank: the head is replicated over TP and DP), bias 0; optimizer's master
        copies follow. A no-op where this pipeline stage holds no head."""
        head = getattr(self.gpt, VALUE_HEAD, None)
        if head is None:
            return
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=torch.float32) * std)
            head.bias.zero_()
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def values(self, batch: StepBatch) -> torch.Tensor:
        """[b, T] fp32 values of this rank's rows at their response tokens (no gradients),
        on every rank of the replica."""
        return self.score(batch).logp_BT  # (the scoring pass's per-token output: here values)


class Critic(ValueModel):
    """PPO's critic: a value model trained by the critic section's optimizer
    (`Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=n)`)."""
