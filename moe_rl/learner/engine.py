"""The learner: a megatron-core MoE model with its optimizer, scored and trained in
micro-batches through megatron's pipeline schedules.

    init_distributed()
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=n)
        ref = Learner(cfg.model, cfg.parallel, layout)      # no optimizer: frozen, scoring only
        score = learner.score(batch, plan)                  # batch: StepBatch, this rank's rows
        result = learner.update(batch.scored(score.logp_BT, score.record), loss_fn, plan)
        logp_BT = learner.logprobs(tokens)                  # a whole TokenBatch, on every rank

Data layout. A pass runs on a `StepBatch`: the rows this data-parallel rank holds (the
ranks of one model replica hold the same rows; see `moe_rl.step_batch`). They are cut into
micro-batches, as many on every data-parallel rank (expert-parallel all-to-alls need all
ranks in every micro-batch), the last filled with padding rows that have no response
tokens and contribute nothing to any loss. Outputs ([b, T] logprobs, routing records) stay
with the rows; only scalar metrics and the batch's global counts cross data-parallel ranks.
The whole-batch helpers (`logprobs`, `score_whole`, `train_step`, `forward_backward`) take
the same whole batch on every rank, run each rank's rows and assemble the result everywhere
(tests, tools and SFT use them).

Configuration. A learner holds the recipe sections it is built from, and no others: the
model (`model_cfg`), the parallel layout's settings (`parallel_cfg`: micro-batching,
packing, the log-prob chunk) and, when it trains, its optimizer section (`optimizer_cfg`,
the actor's `optimizer` or PPO's `critic.optimizer`: one section type). `total_updates`, the
optimizer steps its learning-rate schedule spans, is the caller's count (an RL run's
`epochs x num_minibatches` per actor step, SFT's and DPO's run.steps, ...).

Loss scaling. A loss callback returns each micro-batch's *contribution* to the whole-batch
loss (the objectives take global token / sequence normalisers, so contributions sum to the
whole-batch loss). megatron's schedule divides every micro-batch loss by the number of
micro-batches and DDP averages gradients over data-parallel ranks; we multiply by both
counts to undo that, so the gradient is exactly that of the summed contributions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from moe_rl.batch import TokenBatch
from moe_rl.config import ModelConfig, OptimizerConfig, ParallelConfig
from moe_rl.learner.finite import update_is_finite
from moe_rl.learner.lora import apply_lora, freeze
from moe_rl.learner.microbatch import (
    BatchTotals,
    ForwardHooks,
    LossFn,
    MicroBatch,
    MicroBatchLoss,
    PassScaledLoss,
    PassWork,
    ScoreResult,
    UpdateResult,
    bins_needed,
    budget_micro_batches,
    padded_seq_len,
    split_micro_batches,
    token_budget_bins,
)
from moe_rl.learner.model import build_gpt, transformer_config, wrap_ddp
from moe_rl.learner.model_input import packed_input, packed_seq_params, padded_input, padding_mask
from moe_rl.learner.optimizer import build_optimizer
from moe_rl.learner.output_head import OutputHead
from moe_rl.learner.parallel import Layout, active_seed, all_reduce_, comm_device
from moe_rl.learner.reduce import reduce_metrics, reduce_sums
from moe_rl.learner.routing import RouterTaps, RoutingPlan
from moe_rl.learner.routing.compare import sampler_disagreement
from moe_rl.routing.record import ReplayIds, RoutingRecord, row_positions
from moe_rl.runtime import manual_gc
from moe_rl.runtime.collectives import all_gather_object
from moe_rl.runtime.fault_hooks import kill_point, nan_update_due
from moe_rl.step_batch import StepBatch, dp_rows

log = logging.getLogger(__name__)
T = TypeVar("T")


def _poisoned(loss_fn: LossFn) -> LossFn:
    """`loss_fn` with a NaN loss: what the test hook injects (`moe_rl.runtime.fault_hooks`)."""

    def poisoned(logp_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss:
        out = loss_fn(logp_BT, mb)
        return MicroBatchLoss(out.loss * float("nan"), out.metrics, out.weight, out.sums)

    return poisoned


def _detached(t: torch.Tensor) -> torch.Tensor:
    """`t` without its graph (itself when it has none: a detach is an op too)."""
    return t.detach() if t.requires_grad else t


class Learner:
    """A megatron-core MoE policy (this rank's shard), its optimizer and LR schedule."""

    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        layout: Layout,
        *,
        optimizer: OptimizerConfig | None = None,
        total_updates: int | None = None,
    ) -> None:
        """`optimizer`: the section of the optimizer that trains it (None: frozen, scoring
        only: a reference model); `total_updates`: the optimizer steps its learning-rate
        schedule spans (>= 1; a trainable learner needs it, a frozen one takes none)."""
        if optimizer is not None and (total_updates is None or total_updates < 1):
            raise ValueError(f"a trainable learner needs total_updates >= 1 (its schedule's length), got {total_updates}")
        if optimizer is None and total_updates is not None:
            raise ValueError("a learner without an optimizer is frozen: it takes no total_updates")
        self.model_cfg, self.parallel_cfg, self.optimizer_cfg = model, parallel, optimizer
        self.layout = layout
        self.tcfg = transformer_config(model, parallel)
        self.gpt = build_gpt(model, self.tcfg)
        apply_lora(self.gpt, model, active_seed())
        freeze(self.gpt, model)
        self._prepare_model(self.gpt)
        self.trainable = optimizer is not None
        self.packing = parallel.packing
        """Pack micro-batches (THD); false: the padded reference path (switchable per pass
        only on a learner built with packing on: pipeline stages then exchange shapes)."""
        self.step = 0
        self.base_origin: str | None = None
        """Where the weights were loaded from (a checkpoint or Hugging Face directory; a
        checkpoint's own record of it when it has one): what a LoRA / frozen run's
        checkpoints name as their frozen base's origin."""
        self.skipped_in_a_row = 0
        """Updates skipped in a row (a NaN or inf loss or gradient), up to the last one."""
        self.optimizer = None
        self.scheduler = None
        if optimizer is not None and total_updates is not None:  # (checked above: both or neither)
            self.model = wrap_ddp(self.gpt, self.tcfg, distributed_optimizer=optimizer.distributed)
            self.tcfg.finalize_model_grads_func = finalize_model_grads
            self.tcfg.grad_scale_func = None
            bf16 = model.dtype_on(torch.cuda.is_available()) == "bf16"
            self.optimizer, self.scheduler = build_optimizer(optimizer, self.model, total_updates, bf16=bf16)
        else:
            self.model = self.gpt
            for p in self.gpt.parameters():
                p.requires_grad_(False)
        self.head = self._make_head()
        self.taps = RouterTaps(self.gpt, self.tcfg, layout)
        if self.trainable and (not dist.is_initialized() or dist.get_rank() == 0):
            for note in model.training_notes():
                log.info("%s", note)
        self.hooks: ForwardHooks = self.taps

    # ------------------------------------------------------------------ what the model computes per token

    def _prepare_model(self, gpt: torch.nn.Module) -> None:
        """Change the freshly built model before DDP and the optimizer see it (the critic
        adds its value head here)."""

    def _make_head(self) -> Any:
        """What turns the last stage's output into per-token values: here the log-probs
        head; it has `learner_pass()` and `chunk_tokens`."""
        return OutputHead(self.gpt, self.parallel_cfg.logprob_chunk_tokens, self.layout.sequence_parallel)

    def _token_outputs(self, output: torch.Tensor, mb: MicroBatch,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([b, T] per-token values the loss callback gets, [b, T] entropy or None): the
        policy's log-probs of the response tokens (their entropy in scoring passes: an update
        does not use it)."""
        return self.head.logprobs(output, mb, temperature, entropy=self._scoring)

    # ------------------------------------------------------------------ batching

    def _micro_batches(self, batch: StepBatch) -> list[MicroBatch]:
        """This rank's rows in micro-batches, as many as on every other data-parallel rank,
        each carrying the pass's global counts (one small all-reduce of each over DP) and
        its model input (packed or padded, `model_input`)."""
        lens = batch.tokens.response_mask().sum(1)  # (the policy's tokens; an episode's observations are not)
        counts = torch.tensor([float(lens.sum()), float((lens > 0).sum()), float(batch.batch_size)],
                              dtype=torch.float64)
        most = torch.tensor([batch.batch_size], dtype=torch.int64)
        if self.layout.dp > 1:
            group = ps.get_data_parallel_group()
            all_reduce_(counts, group=group)
            all_reduce_(most, op=dist.ReduceOp.MAX, group=group)
        totals = BatchTotals(*counts.tolist())
        fp8 = self.model_cfg.fp8 != "none"
        S = padded_seq_len(batch.tokens.seq_len, self.layout.tp, fp8=fp8)
        multiple = padded_seq_len(1, self.layout.tp, fp8=fp8)  # what SP (and fp8) need of a segment
        budget = self.parallel_cfg.max_tokens_per_microbatch
        if budget and self.packing:
            mbs = budget_micro_batches(batch, self._token_bins(batch, budget, multiple), S, totals)
        else:
            mbs = split_micro_batches(batch, self.parallel_cfg.micro_batch_size, int(most), S, totals)
        for mb in mbs:
            valid = mb.rows_B >= 0
            mb.inp = (packed_input(mb.batch, multiple, valid) if self.packing
                      else padded_input(mb.batch, S, valid))
            mb.padding_BS = padding_mask(mb.inp, self.layout)
        return mbs

    def _token_bins(self, batch: StepBatch, budget: int, multiple: int) -> list[list[int]]:
        """This rank's rows in as many token-budget bins as the most any data-parallel rank
        needs (megatron's schedule runs the same number of micro-batches everywhere)."""
        cost = (-(-batch.tokens.total_lens_B // multiple) * multiple).tolist()  # packed segment sizes
        n = torch.tensor([bins_needed(cost, budget)], dtype=torch.int64)
        while True:
            if self.layout.dp > 1:
                all_reduce_(n, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            bins = token_budget_bins(cost, budget, max(int(n), 1))
            short = torch.tensor([int(bins is None)], dtype=torch.int64)
            if self.layout.dp > 1:
                all_reduce_(short, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            if not int(short) and bins is not None:
                return bins
            n += 1

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
        inp = mb.inp
        assert inp is not None and mb.padding_BS is not None  # (set by _micro_batches)
        tokens, positions, pad_BS = inp.tokens, inp.positions, mb.padding_BS
        mb.scored = inp.scored
        if torch.cuda.is_available():  # the loss callback then sees device tensors only
            dev = torch.device("cuda", torch.cuda.current_device())
            mb.step, mb.scored = mb.step.to(dev), inp.scored.to(dev)
            tokens, positions, pad_BS = (t.to(dev, non_blocking=True) for t in (tokens, positions, pad_BS))
        extra: dict[str, Any] = {"padding_mask": pad_BS}  # (the MoE losses count real tokens only)
        if inp.packed:
            extra["packed_seq_params"] = packed_seq_params(inp, tokens.device)
        output = model(input_ids=tokens, position_ids=positions, attention_mask=None, **extra)
        self.hooks.after_forward(mb)
        return output, partial(self._loss_on_last_stage, loss_fn, temperature, mb)

    def _loss_on_last_stage(
        self, loss_fn: LossFn | None, temperature: float, mb: MicroBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        logp_BT, entropy_BT = self._token_outputs(logits, mb, temperature)
        mb.aux = self.hooks.loss_aux(mb)
        item: dict[str, Any] = {"logp_BT": _detached(logp_BT), "batch_pos_B": mb.batch_pos_B}
        if entropy_BT is not None:
            item["entropy_BT"] = _detached(entropy_BT)
        if loss_fn is None:  # scoring only
            if "router_shift_BT" in mb.aux:
                item["router_shift_BT"] = mb.aux["router_shift_BT"]
            return logp_BT.new_zeros(()), item
        out = loss_fn(logp_BT, mb)
        # Undo megatron's 1/num_microbatches (schedule) and 1/dp (DDP) averaging: the
        # callback's contributions already carry the global normalisers.
        scale = self._num_microbatches * self.layout.dp
        item.update(loss=_detached(out.loss), metrics={k: _detached(v) for k, v in out.metrics.items()},
                    weight=out.weight, sums=out.sums)
        return out.loss * scale, item

    def _run(self, batch: StepBatch, loss_fn: LossFn | None, temperature: float) -> list[dict[str, Any]]:
        mbs = self._micro_batches(batch)
        self._num_microbatches = len(mbs)
        self._scoring = loss_fn is None
        inps = [mb.inp for mb in mbs if mb.inp is not None]  # (every one: set by _micro_batches)
        self._slots = [sum(inp.slots for inp in inps), sum(inp.real_tokens for inp in inps),
                       float((batch.tokens.total_lens_B.double() ** 2).sum())]
        forward_backward = get_forward_backward_func()
        with self.head.learner_pass():
            return forward_backward(
                forward_step_func=partial(self._forward_step, loss_fn, temperature),
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=len(mbs),
                seq_length=inps[0].tokens.shape[1],  # (packed: pipeline stages exchange shapes)
                micro_batch_size=inps[0].tokens.shape[0],
                forward_only=loss_fn is None,
            )

    # ------------------------------------------------------------------ public API: this rank's rows

    @torch.no_grad()
    def score(self, batch: StepBatch, plan: RoutingPlan | None = None, temperature: float = 1.0) -> ScoreResult:
        """Log-probabilities of the response tokens of this rank's rows ([b, T] fp32, on
        every rank of the replica); with `plan.capture`, this rank's routing record (its
        rows, its stage's layers); with `plan.old`, the router-shift weights ([b, T])."""
        self.model.eval()
        plan = plan or RoutingPlan()
        with self.taps.run(plan):
            store = self._run(batch, None, temperature)
            record = self.taps.record()
        keys = ["logp_BT", "router_shift_BT" if plan.old is not None else None,
                "entropy_BT" if self.head.chunk_tokens else None]
        logp, gamma, entropy = self._collect(store, keys, batch.batch_size, batch.tokens.response_width)
        assert logp is not None  # (a key given: collected)
        return ScoreResult(logp, record, gamma, entropy)

    def update(self, batch: StepBatch, loss_fn: LossFn, plan: RoutingPlan | None = None,
               temperature: float = 1.0) -> UpdateResult:
        """One optimizer update on this rank's rows of a mini-batch (every data-parallel rank
        calls it with its own rows). With `plan.old`, the loss callback finds
        `mb.aux["router_shift_BT"]` and the metrics include the routing statistics; with
        `plan.replay`, those ids are replayed. Returns the metrics (the same on every rank)
        and the logprobs and routing record the forward computed before the update."""
        t0 = time.perf_counter()
        if nan_update_due(self.step + 1):  # (a test hook: a no-op unless MOE_RL_TEST_NAN_AT names this update)
            loss_fn = _poisoned(loss_fn)
        metrics, logp, record, sums = self._gradients(batch, loss_fn, plan, temperature)
        ok, grad_norm = False, None
        kill_point("update")  # (a test hook: mid-step, the gradients computed, nothing applied yet)
        assert self.optimizer is not None and self.scheduler is not None  # (_gradients refused a frozen learner)
        if update_is_finite(self.model, metrics.get("loss", 0.0)):  # (collective) else: skipped, never applied
            ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.step += 1
        self.skipped_in_a_row = 0 if ok else self.skipped_in_a_row + 1
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_skipped"] = float(not ok)
        metrics["skipped_in_a_row_max"] = float(self.skipped_in_a_row)  # (max over a step's updates: a streak only grows within it)
        throughput, work = self._throughput(time.perf_counter() - t0)
        metrics.update(throughput)
        manual_gc.tick(self.parallel_cfg.manual_gc_interval)  # (after the timing: parallel.manual_gc_interval)
        return UpdateResult(metrics, logp, record, work, sums)

    def _throughput(self, seconds: float) -> tuple[dict[str, float], PassWork]:
        """The last pass's token slots: padding fraction and real tokens per second over
        every data-parallel rank (one small all-reduce), and this rank's micro-batches; and
        the pass's work (real tokens, squared sequence lengths, seconds) for the program's
        perf/* metrics."""
        slots = torch.tensor(self._slots, dtype=torch.float64)
        if self.layout.dp > 1:
            all_reduce_(slots, group=ps.get_data_parallel_group())
        total, real, squares = slots.tolist()
        return ({"pad_frac": (total - real) / total if total else 0.0,
                 "tokens_per_s": real / seconds if seconds > 0 else 0.0,
                 "microbatches": float(self._num_microbatches)}, PassWork(real, squares, seconds))

    def _gradients(self, batch: StepBatch, loss_fn: LossFn, plan: RoutingPlan | None, temperature: float
                   ) -> tuple[dict[str, float], torch.Tensor, RoutingRecord | None, dict[str, float]]:
        """Gradients of the summed loss contributions into the grad buffers (`main_grad`,
        reduced over data-parallel ranks), without an optimizer step; with a
        `PassScaledLoss`, scaled by its pass-wide factor. Also the loss's tallies."""
        if not self.trainable or self.optimizer is None:
            raise RuntimeError("this learner was built without an optimizer (frozen): it cannot train")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        plan = plan or RoutingPlan()
        with self.taps.run(plan):
            store = self._run(batch, loss_fn, temperature)
            routing_metrics = self.taps.shift_metrics() if plan.old is not None else {}
            record = self.taps.record()
        last = self.layout.is_last_stage
        metrics, sums = self._broadcast_object((reduce_metrics(store, self.layout), reduce_sums(store, self.layout))
                                               if last else ({}, {}))
        if isinstance(loss_fn, PassScaledLoss):
            scale = loss_fn.pass_scale(sums)
            if scale != 1.0:  # (the same factor on every rank and stage: they all hold `sums`)
                self.model.scale_gradients(scale)
                metrics["loss"] = metrics.get("loss", 0.0) * scale
        metrics.update(routing_metrics)
        logp = self._collect(store, ["logp_BT"], batch.batch_size, batch.tokens.response_width)[0]
        assert logp is not None  # (a key given: collected)
        return metrics, logp, record, sums

    def _collect(self, store: list[dict[str, Any]], keys: list[str | None], rows: int,
                 width: int) -> list[torch.Tensor | None]:
        """[rows, T] per key (None: skipped) from the last stage's per-micro-batch pieces, on
        every stage: every piece comes to the host in one copy (one wait for a GPU)."""
        wanted = [k for k in keys if k is not None]
        outs = {k: torch.zeros(rows, width, dtype=torch.float32) for k in wanted}
        if self.layout.is_last_stage and store:
            pos = torch.cat([item["batch_pos_B"] for item in store])
            valid = pos >= 0
            pieces = torch.stack([torch.cat([item[k].float() for item in store]) for k in wanted]).cpu()
            for k, piece in zip(wanted, pieces):
                outs[k][pos[valid]] = piece[valid]
        return [self._from_last_stage(outs[k]) if k is not None else None for k in keys]

    # ------------------------------------------------------------------ public API: whole batches

    def own_rows(self, tokens: TokenBatch, extras: dict[str, torch.Tensor] | None = None) -> StepBatch:
        """This data-parallel rank's rows of a whole batch (every rank holds `tokens`)."""
        whole = StepBatch.whole(tokens, extras=dict(extras or {}))
        return whole.take(dp_rows(tokens.batch_size, self.layout.dp_rank, self.layout.dp))

    def _whole(self, part_bT: torch.Tensor, rows: StepBatch, B: int) -> torch.Tensor:
        """[B, T] on every rank from each data-parallel rank's rows (a sum of disjoint rows)."""
        out = torch.zeros(B, part_bT.shape[1], dtype=torch.float32)
        out[rows.row_ids_B] = part_bT
        if self.layout.dp > 1:
            all_reduce_(out, group=ps.get_data_parallel_group())
        return out

    def score_whole(self, tokens: TokenBatch, temperature: float = 1.0,
                    routing: RoutingPlan | None = None) -> ScoreResult:
        """`score` of a whole batch: logprobs (router-shift weights, entropy) [B, T] on every
        rank; the routing record holds this rank's rows (by global row id)."""
        rows = self.own_rows(tokens)
        res = self.score(rows, routing, temperature)

        def whole(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else self._whole(t, rows, tokens.batch_size)

        return ScoreResult(self._whole(res.logp_BT, rows, tokens.batch_size), res.record, whole(res.router_shift_BT),
                           whole(res.entropy_BT))

    def logprobs(self, tokens: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T] fp32 log-probabilities of the response tokens of a whole batch, on every rank."""
        return self.score_whole(tokens, temperature).logp_BT

    def forward_backward(self, tokens: TokenBatch, loss_fn: LossFn, extras: dict[str, torch.Tensor] | None = None,
                         temperature: float = 1.0, routing: RoutingPlan | None = None) -> dict[str, float]:
        """Gradients of a whole batch's loss into the grad buffers, no optimizer step; metrics."""
        return self._gradients(self.own_rows(tokens, extras), loss_fn, routing, temperature)[0]

    def train_step(self, tokens: TokenBatch, loss_fn: LossFn, extras: dict[str, torch.Tensor] | None = None,
                   temperature: float = 1.0, routing: RoutingPlan | None = None) -> dict[str, float]:
        """`update` on a whole batch (`extras`: per-row tensors the loss callback reads from
        `mb.extras`). Returns the metrics."""
        return self.update(self.own_rows(tokens, extras), loss_fn, routing, temperature).metrics

    # ------------------------------------------------------------------ routing plans

    def routing_plan(self, replay: str, batch: StepBatch, *, capture: bool = False) -> RoutingPlan:
        """What the routers do in a pass over `batch` under routing-replay mode `replay`
        (none|R2|R3): the one place a plan is chosen.

        Before the batch is scored (`batch.old_routing` is None: the scoring pass, or the
        on-policy update whose forward is the scoring): record this rank's routing when
        `capture`; under R3 the sampler's ids are replayed. Once scored: the router shift is
        measured against `batch.old_routing`; R2 replays its ids, R3 the sampler's. Replay
        ids are cut to this pipeline stage's MoE layers here."""
        if replay not in ("none", "R2", "R3"):
            raise ValueError(f"replay={replay!r}; valid: none, R2, R3")
        forced = None
        if replay == "R3":
            if batch.sampler_routing is None:
                raise ValueError("R3 replay needs the sampler's routing (a backend that returns routed experts)")
            forced = batch.sampler_routing.select_layers(self.taps.layers)
        old = batch.old_routing
        if old is None:
            return RoutingPlan(capture=capture, replay=forced)
        if replay == "R2":
            forced = ReplayIds.from_record(old)
        return RoutingPlan(old=old, replay=forced)

    def sampler_disagreement(self, record: RoutingRecord, batch: StepBatch) -> dict[str, float]:
        """Per-layer fraction of scored positions where the sampler's top-k set differs from
        this learner's own routing in `record` (collective; see routing.sampler_disagreement)."""
        scored_RS = batch.tokens.scored_positions()[row_positions(batch.row_ids_B, record.rows)]
        if batch.sampler_routing is None:
            raise ValueError("sampler_disagreement needs the sampler's routing (a backend that returns routed experts)")
        return sampler_disagreement(record, batch.sampler_routing.select_layers(record.layers), scored_RS,
                                    self.layout)

    # ------------------------------------------------------------------ collectives for callers

    def all_gather_object(self, obj: T, group: dist.ProcessGroup | None = None) -> list[T]:
        """Every rank's picklable `obj` in `group` (default: every learner rank), in rank order."""
        return all_gather_object(obj, group)

    def dp_gather_object(self, obj: T) -> list[T]:
        """Every data-parallel rank's `obj` (one per model replica), in data-parallel rank order."""
        if self.layout.dp == 1:
            return [obj]
        return self.all_gather_object(obj, ps.get_data_parallel_group())

    # ------------------------------------------------------------------ pipeline helpers

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
