"""The learner: a megatron-core MoE model with its optimizer, scored and trained in
micro-batches through megatron's pipeline schedules.

    init_distributed()
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        learner = Learner(cfg, layout)
        logp_BT = learner.logprobs(batch)                 # every rank gets [B, T]
        metrics = learner.train_step(batch, loss_fn, extras={"adv_B": adv_B, ...})

Data layout. Every rank is handed the same global batch (with global row ids, so a
mini-batch keeps the identity of its rollout rows). Data-parallel rank r takes the rows
whose id is r mod dp, in every pass, cuts them into micro-batches and pads the last with
empty sequences so that every rank runs the same number of micro-batches (expert-parallel
all-to-alls need all ranks in every micro-batch). Padding sequences have no response
tokens, so they contribute nothing to any loss.

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
from moe_rl.config import Config, ConfigError
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.microbatch import (
    BatchTotals,
    ForwardHooks,
    LossFn,
    MicroBatch,
    ScoreResult,
    padded_seq_len,
)
from moe_rl.learner.model import build_gpt, transformer_config, wrap_ddp
from moe_rl.learner.parallel import Layout, all_reduce_, comm_device
from moe_rl.learner.routing import RouterTaps, RoutingPlan, sampler_disagreement
from moe_rl.metrics import reduction
from moe_rl.routing.record import ReplayIds, RoutingRecord

log = logging.getLogger(__name__)


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
            self.model = wrap_ddp(self.gpt, self.tcfg,
                                  distributed_optimizer=cfg.optimizer.distributed)
            self.tcfg.finalize_model_grads_func = finalize_model_grads
            self.tcfg.grad_scale_func = None
            self._build_optimizer(total_updates or max(1, cfg.run.steps * cfg.rl.num_minibatches * cfg.rl.epochs))
        else:
            self.model = self.gpt
            for p in self.gpt.parameters():
                p.requires_grad_(False)
        self.taps = RouterTaps(self.gpt, self.tcfg, layout)
        self.hooks: ForwardHooks = self.taps

    # ------------------------------------------------------------------ optimizer

    def _build_optimizer(self, total_updates: int) -> None:
        o = self.cfg.optimizer
        bf16 = self.cfg.model.dtype_on(torch.cuda.is_available()) == "bf16"
        if bf16 and not torch.cuda.is_available():
            raise ConfigError(
                "model.params_dtype=bf16 training needs CUDA: megatron-core's mixed-precision "
                "optimizer only takes CUDA tensors. Train in fp32 on CPU (a bf16 learner can still "
                "score with trainable=False, e.g. in tools/measure_mismatch.py)"
            )
        if o.distributed and not torch.cuda.is_available():
            raise ConfigError("optimizer.distributed=true needs CUDA: megatron-core's distributed optimizer only "
                              "takes CUDA tensors; leave it false on CPU")
        if self.cfg.model.recompute != "none":
            raise ConfigError("model.recompute=full is not supported by the learner yet: the routing taps would "
                              "see each router twice per micro-batch (the planner accounts for it)")
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
                use_distributed_optimizer=o.distributed,
                optimizer_cpu_offload=o.offload_fraction > 0,
                optimizer_offload_fraction=o.offload_fraction,
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
        self, batch: TokenBatch, extras: dict[str, torch.Tensor], row_ids: torch.Tensor | None
    ) -> list[MicroBatch]:
        """This DP rank's rows of the batch, cut into equally many micro-batches on every rank.

        Row ownership is by global row id (`row_id % dp`), so a sequence is processed by the
        same data-parallel rank in every pass of a step (old logprobs, each mini-batch update)
        and per-row state such as a routing record never has to move between ranks.
        """
        B = batch.batch_size
        for k, v in extras.items():
            if v.shape[0] != B:
                raise ValueError(f"extras[{k!r}] has leading dim {v.shape[0]}, batch has {B}")
        if row_ids is None:
            row_ids = torch.arange(B)
        if row_ids.shape != (B,):
            raise ValueError(f"row_ids must have shape [{B}], got {tuple(row_ids.shape)}")
        dp, mbs = self.layout.dp, self.cfg.parallel.micro_batch_size
        counts = torch.bincount(row_ids % dp, minlength=dp)
        most = max(int(counts.max()), 1)
        mbs_eff = min(mbs, most)
        n_micro = math.ceil(most / mbs_eff)
        mine = torch.nonzero(row_ids % dp == self.layout.dp_rank).flatten()  # batch positions
        pos = torch.full((n_micro * mbs_eff,), -1, dtype=torch.long)
        pos[: mine.numel()] = mine
        S = padded_seq_len(batch.seq_len, self.layout.tp, fp8=self.cfg.model.fp8 != "none")
        valid = pos >= 0
        safe = pos.clamp(min=0)
        tokens = batch.tokens_BS.new_zeros((pos.numel(), S))
        tokens[:, : batch.seq_len] = batch.tokens_BS[safe]
        prompt = torch.where(valid, batch.prompt_lens_B[safe], 1)
        resp = torch.where(valid, batch.response_lens_B[safe], 0)
        rows = torch.where(valid, row_ids[safe], -1)
        totals = BatchTotals.of(batch)
        out = []
        for i in range(n_micro):
            sl = slice(i * mbs_eff, (i + 1) * mbs_eff)
            v = valid[sl]
            mb_extras = {}
            for k, x in extras.items():
                y = x.new_zeros((mbs_eff, *x.shape[1:]))
                y[v] = x[pos[sl][v]]
                mb_extras[k] = y
            out.append(MicroBatch(
                index=i,
                batch=TokenBatch(tokens[sl], prompt[sl], resp[sl], batch.response_width),
                rows_B=rows[sl],
                extras=mb_extras,
                batch_pos_B=pos[sl],
                totals=totals,
            ))
        return out

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
        if torch.cuda.is_available():  # the loss callback then sees device tensors only
            dev = torch.device("cuda", torch.cuda.current_device())
            mb.batch = mb.batch.to(dev)
            mb.extras = {k: v.to(dev, non_blocking=True) for k, v in mb.extras.items()}
        tokens = mb.batch.tokens_BS
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        output = model(input_ids=tokens, position_ids=positions, attention_mask=None)
        self.hooks.after_forward(mb)
        return output, partial(self._loss_on_last_stage, loss_fn, temperature, mb)

    def _loss_on_last_stage(
        self, loss_fn: LossFn | None, temperature: float, mb: MicroBatch, logits_BSV: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        logp_BT = response_logprobs(logits_BSV, mb.batch, temperature)
        mb.aux = self.hooks.loss_aux(mb)
        if loss_fn is None:  # scoring only
            item = {"logp_BT": logp_BT.detach(), "batch_pos_B": mb.batch_pos_B}
            if "router_shift_BT" in mb.aux:
                item["router_shift_BT"] = mb.aux["router_shift_BT"]
            return logp_BT.new_zeros(()), item
        out = loss_fn(logp_BT, mb)
        # Undo megatron's 1/num_microbatches (schedule) and 1/dp (DDP) averaging: the
        # callback's contributions already carry the global normalisers.
        scale = self._num_microbatches * self.layout.dp
        reduced = {"loss": out.loss.detach(), "metrics": {k: v.detach() for k, v in out.metrics.items()},
                   "weight": torch.as_tensor(out.weight, dtype=torch.float64, device=out.loss.device),
                   "logp_BT": logp_BT.detach(), "batch_pos_B": mb.batch_pos_B}  # (train_step_scored)
        return out.loss * scale, reduced

    def _run(self, batch: TokenBatch, loss_fn: LossFn | None, extras: dict[str, torch.Tensor],
             temperature: float, row_ids: torch.Tensor | None) -> tuple[list[MicroBatch], list[dict[str, Any]]]:
        mbs = self._local_micro_batches(batch, extras, row_ids)
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
    def score(
        self,
        batch: TokenBatch,
        temperature: float = 1.0,
        routing: RoutingPlan | None = None,
        row_ids: torch.Tensor | None = None,
    ) -> ScoreResult:
        """Log-probabilities of the response tokens ([B, T] fp32, on every rank); with
        `routing.capture`, this rank's routing record (its rows, its stage's layers); with
        `routing.old`, the router-shift weights the current router would get ([B, T])."""
        self.model.eval()
        plan = routing or RoutingPlan()
        with self.taps.run(plan):
            _, store = self._run(batch, None, {}, temperature, row_ids)
            record = self.taps.record()
        logp = self._assemble(store, "logp_BT", batch)
        gamma = self._assemble(store, "router_shift_BT", batch) if plan.old is not None else None
        return ScoreResult(logp, record, gamma)

    def _assemble(self, store: list[dict[str, Any]], key: str, batch: TokenBatch) -> torch.Tensor:
        """[B, T] from per-micro-batch pieces on the last stage, on every rank."""
        out = torch.zeros(batch.batch_size, batch.response_width, dtype=torch.float32)
        if self.layout.is_last_stage:
            for item in store:
                pos = item["batch_pos_B"]
                valid = pos >= 0
                out[pos[valid].cpu()] = item[key][valid.to(item[key].device)].float().cpu()
            if self.layout.dp > 1:
                # Each DP rank filled its own rows (others are 0): a sum assembles the batch.
                all_reduce_(out, group=ps.get_data_parallel_group())
        return self._from_last_stage(out)

    def logprobs(self, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T] fp32 log-probabilities of the response tokens, on every rank."""
        return self.score(batch, temperature).logp_BT

    def forward_backward(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        extras: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
        routing: RoutingPlan | None = None,
        row_ids: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Gradients of the summed loss contributions into the grad buffers (`main_grad`,
        reduced over data-parallel ranks), without an optimizer step. Returns metrics."""
        metrics, _ = self._forward_backward(batch, loss_fn, extras, temperature, routing, row_ids, scored=False)
        return metrics

    def _forward_backward(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        extras: dict[str, torch.Tensor] | None,
        temperature: float,
        routing: RoutingPlan | None,
        row_ids: torch.Tensor | None,
        scored: bool,
    ) -> tuple[dict[str, float], ScoreResult | None]:
        if not self.trainable:
            raise RuntimeError("this learner was built with trainable=False")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        plan = routing or RoutingPlan()
        with self.taps.run(plan):
            _, store = self._run(batch, loss_fn, extras or {}, temperature, row_ids)
            routing_metrics = self.taps.shift_metrics() if plan.old is not None else {}
            record = self.taps.record()
        metrics = self._reduce_metrics(store) if self.layout.is_last_stage else {}
        metrics = self._broadcast_object(metrics)
        metrics.update(routing_metrics)
        score = ScoreResult(self._assemble(store, "logp_BT", batch), record) if scored else None
        return metrics, score

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        extras: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
        routing: RoutingPlan | None = None,
        row_ids: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer update on `batch`. Returns metrics (same on every rank). With
        `routing.old`, the loss callback finds `mb.aux["router_shift_BT"]` and the metrics
        include the routing statistics; with `routing.replay`, those ids are replayed."""
        metrics, _ = self.train_step_scored(batch, loss_fn, extras, temperature, routing, row_ids, scored=False)
        return metrics

    def train_step_scored(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        extras: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
        routing: RoutingPlan | None = None,
        row_ids: torch.Tensor | None = None,
        scored: bool = True,
    ) -> tuple[dict[str, float], ScoreResult | None]:
        """`train_step`, also returning what its forward computed before the update: the
        logprobs ([B, T], every rank) and, with `routing.capture`, the routing record. At
        one update per rollout these are the old logprobs (the on-policy shortcut)."""
        metrics, score = self._forward_backward(batch, loss_fn, extras, temperature, routing, row_ids, scored)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.step += 1
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        return metrics, score

    # ------------------------------------------------------------------ routing plans

    def routing_plan(
        self,
        replay: str,
        *,
        capture: bool = False,
        old: RoutingRecord | None = None,
        sampler: ReplayIds | None = None,
    ) -> RoutingPlan:
        """What the routers do in one pass under routing-replay mode `replay` (none|R2|R3).

        Scoring pass (`old` is None): record this rank's routing when `capture`; under R3
        the sampler's ids are replayed. Update pass (`old` is the scoring pass's record):
        the router shift is measured against `old`; R2 replays `old`'s ids, R3 the
        sampler's. Replay ids are cut to this pipeline stage's MoE layers here."""
        if replay not in ("none", "R2", "R3"):
            raise ValueError(f"replay={replay!r}; valid: none, R2, R3")
        forced = None
        if replay == "R3":
            if sampler is None:
                raise ValueError("R3 replay needs the sampler's routing (a backend that returns routed experts)")
            forced = sampler.select_layers(self.taps.layers)
        if old is None:
            return RoutingPlan(capture=capture, replay=forced)
        if replay == "R2":
            forced = ReplayIds.from_record(old)
        return RoutingPlan(old=old, replay=forced)

    def sampler_disagreement(self, record: RoutingRecord, sampler: ReplayIds, batch: TokenBatch) -> dict[str, float]:
        """Per-layer fraction of scored positions where the sampler's top-k set differs from
        this learner's own routing in `record` (collective; see routing.sampler_disagreement)."""
        scored_RS = batch.scored_positions()[record.rows]
        return sampler_disagreement(record, sampler.select_layers(record.layers), scored_RS, self.layout)

    # ------------------------------------------------------------------ collectives for callers

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every learner rank's picklable `obj`, in rank order, on every learner rank."""
        if dist.get_world_size() == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """A picklable object from global rank `src` to every rank (rollouts, decisions)."""
        if dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # ------------------------------------------------------------------ reductions

    def _reduce_metrics(self, store: list[dict[str, Any]]) -> dict[str, float]:
        """Combine per-micro-batch metrics on the last stage, then across DP ranks, each by
        the reduction its name asks for (`moe_rl.metrics.reduction`)."""
        names = sorted({k for item in store for k in item["metrics"]})
        by_kind = {kind: [n for n in names if reduction(n) == kind] for kind in ("mean", "max", "min")}
        loss = torch.stack([item["loss"].double() for item in store]).sum().reshape(1)
        sums, weights = [], []
        for n in by_kind["mean"]:
            vals = [(item["metrics"][n].double(), item["weight"]) for item in store if n in item["metrics"]]
            sums.append(sum(v * w for v, w in vals))
            weights.append(sum(w for _, w in vals))
        values = {n: torch.stack([item["metrics"][n].double() for item in store if n in item["metrics"]])
                  for n in by_kind["max"] + by_kind["min"]}
        extreme = {"max": [values[n].max() for n in by_kind["max"]], "min": [values[n].min() for n in by_kind["min"]]}
        packed_sum = torch.cat([loss, torch.stack(sums) if sums else loss.new_zeros(0),
                                torch.stack(weights) if weights else loss.new_zeros(0)])
        packed = {kind: torch.stack(v) if v else loss.new_zeros(0) for kind, v in extreme.items()}
        if self.layout.dp > 1:
            group = ps.get_data_parallel_group()
            all_reduce_(packed_sum, group=group)
            for kind, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                if by_kind[kind]:
                    all_reduce_(packed[kind], op=op, group=group)
        out = {"loss": float(packed_sum[0])}
        n_mean = len(sums)
        for i, n in enumerate(by_kind["mean"]):
            w = float(packed_sum[1 + n_mean + i])
            out[n] = float(packed_sum[1 + i]) / w if w > 0 else 0.0
        for kind in ("max", "min"):
            out.update(zip(by_kind[kind], packed[kind].tolist()))
        return out

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.pp > 1:
            buf = t.to(comm_device())
            dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
            t = buf.cpu()
        return t

    def _broadcast_object(self, obj: Any) -> Any:
        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]
