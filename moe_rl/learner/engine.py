"""The learner: a megatron-core MoE model with its optimizer, scored and trained in
micro-batches through megatron's pipeline schedules.

    init_distributed()
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        learner = Learner(cfg, layout)
        logp_BT = learner.logprobs(batch)                 # every rank gets [B, T]
        metrics = learner.train_step(batch, loss_fn, extras={"adv_B": adv_B, ...})

Data layout. Every rank is handed the same global batch. It is padded with empty
sequences to a multiple of `dp * micro_batch_size`, each data-parallel rank takes a
contiguous slice, and the slice is cut into micro-batches. Padding sequences have no
response tokens, so they contribute nothing to any loss.

Loss scaling. A loss callback returns each micro-batch's *contribution* to the whole-batch
loss (the objectives take global token / sequence normalisers, so contributions sum to the
whole-batch loss). megatron's schedule divides every micro-batch loss by the number of
micro-batches and DDP averages gradients over data-parallel ranks; we multiply by both
counts to undo that, so the gradient is exactly that of the summed contributions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from moe_rl.batch import TokenBatch
from moe_rl.config import Config
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_gpt, transformer_config, wrap_ddp
from moe_rl.learner.parallel import Layout

log = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """What a loss callback sees for one micro-batch on the last pipeline stage."""

    index: int
    """Micro-batch index within this rank's step."""
    batch: TokenBatch
    """The micro-batch's sequences."""
    rows_B: torch.Tensor
    """[mbs] row of each sequence in the global batch; -1 marks padding sequences."""
    extras: dict[str, torch.Tensor]
    """Per-sequence tensors of the global batch (leading dim B), sliced to these rows
    (padding rows are zero)."""
    aux: dict[str, Any] = field(default_factory=dict)
    """Side data produced during the forward (e.g. router-shift weights)."""


@dataclass
class MicroBatchLoss:
    """A loss callback's answer for one micro-batch."""

    loss: torch.Tensor
    """Scalar: this micro-batch's contribution to the whole-batch loss."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-d tensors. Names ending in _max / _min reduce by max / min, others by weighted mean."""
    weight: float | torch.Tensor = 1.0
    """Weight of this micro-batch in mean-type metrics (e.g. its valid token count)."""


LossFn = Callable[[torch.Tensor, MicroBatch], MicroBatchLoss]


class ForwardHooks:
    """Extension points around each micro-batch forward (routing capture/replay uses them).

    `before_forward` runs on every stage before the model's forward of a micro-batch;
    `after_forward` after it (before the loss on the last stage); `loss_aux` on the last
    stage returns side data for the loss callback."""

    def before_forward(self, mb: MicroBatch) -> None:
        pass

    def after_forward(self, mb: MicroBatch) -> None:
        pass

    def loss_aux(self, mb: MicroBatch) -> dict[str, Any]:
        return {}


class Learner:
    """A megatron-core MoE policy (this rank's shard), its optimizer and LR schedule."""

    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        *,
        trainable: bool = True,
        total_updates: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.tcfg = transformer_config(cfg.model, cfg.parallel)
        self.gpt = build_gpt(cfg.model, self.tcfg)
        self.trainable = trainable
        self.step = 0
        self.optimizer = None
        self.scheduler = None
        if trainable:
            self.model = wrap_ddp(self.gpt, self.tcfg)
            self.tcfg.finalize_model_grads_func = finalize_model_grads
            self.tcfg.grad_scale_func = None
            self._build_optimizer(total_updates or max(1, cfg.run.steps * cfg.rl.num_minibatches * cfg.rl.epochs))
        else:
            self.model = self.gpt
            for p in self.gpt.parameters():
                p.requires_grad_(False)
        self.hooks: ForwardHooks = ForwardHooks()

    # ------------------------------------------------------------------ optimizer

    def _build_optimizer(self, total_updates: int) -> None:
        o = self.cfg.optimizer
        bf16 = self.cfg.model.params_dtype == "bf16"
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=False,
            ),
            [self.model],
        )
        warmup = min(o.lr_warmup_steps, max(total_updates - 1, 0))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if warmup else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(total_updates, warmup + 1),
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=max(total_updates, 1),
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ batching

    def _local_micro_batches(
        self, batch: TokenBatch, extras: dict[str, torch.Tensor]
    ) -> list[MicroBatch]:
        """Pad the global batch, take this DP rank's slice, cut it into micro-batches."""
        B = batch.batch_size
        for k, v in extras.items():
            if v.shape[0] != B:
                raise ValueError(f"extras[{k!r}] has leading dim {v.shape[0]}, batch has {B}")
        mbs = self.cfg.parallel.micro_batch_size
        dp = self.layout.dp
        per_rank = max(1, math.ceil(B / dp))
        per_rank = math.ceil(per_rank / mbs) * mbs if per_rank > mbs else per_rank
        mbs_eff = min(mbs, per_rank)
        padded = per_rank * dp
        # S must split evenly over TP ranks under sequence parallel.
        S = math.ceil(batch.seq_len / self.layout.tp) * self.layout.tp
        tokens = batch.tokens_BS.new_zeros((padded, S))
        tokens[:B, : batch.seq_len] = batch.tokens_BS
        prompt = torch.ones(padded, dtype=torch.long)
        prompt[:B] = batch.prompt_lens_B
        resp = torch.zeros(padded, dtype=torch.long)
        resp[:B] = batch.response_lens_B
        rows = torch.full((padded,), -1, dtype=torch.long)
        rows[:B] = torch.arange(B)
        lo = self.layout.dp_rank * per_rank
        mbs_list = []
        for i, start in enumerate(range(lo, lo + per_rank, mbs_eff)):
            sl = slice(start, start + mbs_eff)
            r = rows[sl]
            mb_extras = {}
            for k, v in extras.items():
                out = v.new_zeros((mbs_eff, *v.shape[1:]))
                valid = r >= 0
                out[valid] = v[r[valid]]
                mb_extras[k] = out
            mbs_list.append(
                MicroBatch(
                    index=i,
                    batch=TokenBatch(tokens[sl], prompt[sl], resp[sl], batch.response_width),
                    rows_B=r,
                    extras=mb_extras,
                )
            )
        return mbs_list

    # ------------------------------------------------------------------ forward

    def _forward_step(
        self,
        loss_fn: LossFn | None,
        temperature: float,
        data_iterator: Iterator[MicroBatch],
        model: torch.nn.Module,
    ) -> tuple[torch.Tensor, Callable]:
        mb = next(data_iterator)
        self.hooks.before_forward(mb)
        tokens = mb.batch.tokens_BS
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if torch.cuda.is_available():
            tokens, positions = tokens.cuda(), positions.cuda()
        output = model(input_ids=tokens, position_ids=positions, attention_mask=None)
        self.hooks.after_forward(mb)
        return output, partial(self._loss_on_last_stage, loss_fn, temperature, mb)

    def _loss_on_last_stage(
        self, loss_fn: LossFn | None, temperature: float, mb: MicroBatch, logits_BSV: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        logp_BT = response_logprobs(logits_BSV, mb.batch, temperature)
        mb.aux = self.hooks.loss_aux(mb)
        if loss_fn is None:  # scoring only
            return logp_BT.new_zeros(()), {"logp_BT": logp_BT.detach(), "rows_B": mb.rows_B}
        out = loss_fn(logp_BT, mb)
        # Undo megatron's 1/num_microbatches (schedule) and 1/dp (DDP) averaging: the
        # callback's contributions already carry the global normalisers.
        scale = self._num_microbatches * self.layout.dp
        reduced = {"loss": out.loss.detach(), "metrics": {k: v.detach() for k, v in out.metrics.items()},
                   "weight": torch.as_tensor(out.weight, dtype=torch.float64)}
        return out.loss * scale, reduced

    def _run(self, batch: TokenBatch, loss_fn: LossFn | None, extras: dict[str, torch.Tensor],
             temperature: float) -> tuple[list[MicroBatch], list[dict[str, Any]]]:
        mbs = self._local_micro_batches(batch, extras)
        self._num_microbatches = len(mbs)
        forward_backward = get_forward_backward_func()
        store = forward_backward(
            forward_step_func=partial(self._forward_step, loss_fn, temperature),
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=mbs[0].batch.seq_len,
            micro_batch_size=mbs[0].batch.batch_size,
            forward_only=loss_fn is None,
        )
        return mbs, store

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def logprobs(
        self,
        batch: TokenBatch,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """[B, T] fp32 log-probabilities of the response tokens, on every rank."""
        self.model.eval()
        _, store = self._run(batch, None, {}, temperature)
        B, T = batch.batch_size, batch.response_width
        out = torch.zeros(B, T, dtype=torch.float32)
        if self.layout.is_last_stage:
            for item in store:
                valid = item["rows_B"] >= 0
                out[item["rows_B"][valid]] = item["logp_BT"][valid].cpu()
            if self.layout.dp > 1:
                # Each DP rank filled its own rows (others are 0): a sum assembles the batch.
                dist.all_reduce(out, group=ps.get_data_parallel_group())
        return self._from_last_stage(out)

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        extras: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer update on `batch`. Returns metrics (same on every rank)."""
        if not self.trainable:
            raise RuntimeError("this learner was built with trainable=False")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        _, store = self._run(batch, loss_fn, extras or {}, temperature)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.step += 1
        metrics = self._reduce_metrics(store) if self.layout.is_last_stage else {}
        metrics = self._broadcast_object(metrics)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        return metrics

    # ------------------------------------------------------------------ reductions

    def _reduce_metrics(self, store: list[dict[str, Any]]) -> dict[str, float]:
        """Combine per-micro-batch metrics on the last stage, then across DP ranks."""
        group = ps.get_data_parallel_group()
        names = sorted({k for item in store for k in item["metrics"]})
        loss = torch.stack([item["loss"].double() for item in store]).sum().reshape(1)
        sums, weights, maxes, mins = [], [], [], []
        for n in names:
            vals = [(item["metrics"][n].double(), item["weight"]) for item in store if n in item["metrics"]]
            if n.endswith("_max"):
                maxes.append(torch.stack([v for v, _ in vals]).max())
            elif n.endswith("_min"):
                mins.append(torch.stack([v for v, _ in vals]).min())
            else:
                sums.append(sum(v * w for v, w in vals))
                weights.append(sum(w for _, w in vals))
        packed_sum = torch.cat([loss, torch.stack(sums) if sums else loss.new_zeros(0),
                                torch.stack(weights) if weights else loss.new_zeros(0)])
        packed_max = torch.stack(maxes) if maxes else loss.new_zeros(0)
        packed_min = torch.stack(mins) if mins else loss.new_zeros(0)
        if self.layout.dp > 1:
            dist.all_reduce(packed_sum, group=group)
            if maxes:
                dist.all_reduce(packed_max, op=dist.ReduceOp.MAX, group=group)
            if mins:
                dist.all_reduce(packed_min, op=dist.ReduceOp.MIN, group=group)
        out = {"loss": float(packed_sum[0])}
        n_mean = len(sums)
        mean_names = [n for n in names if not n.endswith(("_max", "_min"))]
        for i, n in enumerate(mean_names):
            w = float(packed_sum[1 + n_mean + i])
            out[n] = float(packed_sum[1 + i]) / w if w > 0 else 0.0
        for n, v in zip([n for n in names if n.endswith("_max")], packed_max.tolist()):
            out[n] = v
        for n, v in zip([n for n in names if n.endswith("_min")], packed_min.tolist()):
            out[n] = v
        return out

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.pp > 1:
            dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return t

    def _broadcast_object(self, obj: Any) -> Any:
        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]
