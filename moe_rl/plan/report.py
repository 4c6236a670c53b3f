"""A plan as text for people and as one JSON object for scripts (`--json`).

JSON keys that scripts and tests rely on: `params_total`, `params_active` (ints), `fits`
(bool), `phases` (`rollout` / `update`: peak bytes and fits), and `ranks`, one entry per
distinct rank with `memory_bytes` by kind (the `critic_*` kinds only when `critic` is true:
PPO's value model, `rl.advantage: gae`); the rest (traffic, times, suggestions) is there
for reading; `checkpoint` gives a checkpoint's size (`total_bytes`, `node_bytes`,
`rank_bytes`), its save time (`save_s`, `blocking_s`) and the stop's grace
(`stop_grace_needed_s`, `recommended_stop_grace_s`, `recommended_kill_grace_s`). All memory
in bytes, times in seconds.
"""

from __future__ import annotations

import math
from typing import Any

from moe_rl.plan.checkpoint import LAUNCHER_KILL_S, CheckpointPlan
from moe_rl.plan.critic import has_critic
from moe_rl.plan.hardware import GIB
from moe_rl.plan.planner import Plan
from moe_rl.plan.verdict import Suggestion

GB = 1e9


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:8.2f}"


def _b(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def checkpoint_dict(c: CheckpointPlan) -> dict[str, Any]:
    """The checkpoint as plain data: the fields and the derived sizes, times and graces."""
    derived = ("total_bytes", "save_s", "blocking_s", "in_flight_s", "stop_grace_needed_s", "kill_grace_needed_s",
               "recommended_stop_grace_s", "recommended_kill_grace_s", "stop_grace_ok", "kill_grace_ok")
    out = {**vars(c), **{name: getattr(c, name) for name in derived}, "launcher_kill_s": LAUNCHER_KILL_S}
    return {k: _finite(v) if isinstance(v, float) else v for k, v in out.items()}


def plan_dict(plan: Plan, suggestions: list[Suggestion]) -> dict[str, Any]:
    """The plan as plain data (what `--json` prints)."""
    emb = plan.params_by_kind["embedding"] + plan.params_by_kind["output"]
    return {
        "model_source": plan.source.source,
        "notes": list(plan.source.notes),
        "params_total": plan.params_total,
        "params_active": plan.params_active,
        "params_total_without_embeddings": plan.params_total - emb,
        "params_active_without_embeddings": plan.params_active - emb,
        "params_by_kind": dict(plan.params_by_kind),
        "layout": {**vars(plan.layout), "sequence_parallel": plan.layout.tp > 1},
        "hardware": vars(plan.hw),
        "workload": vars(plan.work),
        "switches": vars(plan.switches),
        "critic": has_critic(plan.cfg.rl),
        "critic_workload": vars(plan.critic_work) if plan.critic_work is not None else None,
        "sampler": {**vars(plan.sampler), "concurrency": plan.sampler.concurrency, "starts": plan.sampler.starts},
        "ranks": [{
            "rank": r.rank, "stage_ranks": list(r.stage_ranks), "pp_rank": r.pp_rank,
            "role": "engine" if r.pp_rank < 0 else "learner", "params": r.params_count,
            "memory_bytes": dict(r.kinds), "host_bytes": dict(r.host), "alternatives_bytes": dict(r.variants),
            "rollout_peak_bytes": r.rollout, "update_peak_bytes": r.update,
            "traffic": [vars(t) for t in ts],
        } for r, ts in zip(plan.all_ranks, [*plan.traffic, ()])],
        "phases": {
            "rollout": {"peak_bytes": plan.rollout_peak, "fits": plan.fits_rollout},
            "update": {"peak_bytes": plan.update_peak, "fits": plan.fits_update},
        },
        "fits": plan.fits,
        "times_s": {k: (v if math.isfinite(v) else None) for k, v in plan.times.items()},
        "checkpoint": checkpoint_dict(plan.checkpoint),
        "suggestions": [{"changes": list(s.changes), "fits": s.plan.fits, "rollout_peak_bytes": s.plan.rollout_peak,
                         "update_peak_bytes": s.plan.update_peak,
                         "step_s": s.plan.times["total"] if math.isfinite(s.plan.times["total"]) else None}
                        for s in suggestions],
    }


def _model_lines(plan: Plan) -> list[str]:
    m, k = plan.cfg.model, plan.params_by_kind
    emb = k["embedding"] + k["output"]
    shared = f" + shared {m.moe_shared_expert_intermediate_size}" if m.moe_shared_expert_intermediate_size else ""
    lines = [
        f"model ({plan.source.source}): {m.num_layers} layers ({m.num_dense_layers} dense), hidden {m.hidden_size}, "
        f"{m.num_attention_heads}/{m.num_query_groups} heads x {m.kv_channels}, {m.num_experts} experts "
        f"top-{m.moe_router_topk} (ffn {m.moe_ffn_hidden_size}{shared}), vocab {m.vocab_size}, {m.dtype_on(True)}"
        + (f" + fp8 {m.fp8}" if m.fp8 != "none" else ""),
        f"  parameters: {_b(plan.params_total)} total, {_b(plan.params_active)} active per token "
        f"(without embeddings: {_b(plan.params_total - emb)} / {_b(plan.params_active - emb)})",
        "  by kind: " + ", ".join(f"{name} {_b(n)}" for name, n in k.items() if n),
    ]
    lines += [f"  note: {n}" for n in plan.source.notes]
    return lines


def _setup_lines(plan: Plan) -> list[str]:
    w, hw, s = plan.work, plan.hw, plan.sampler
    sw = plan.switches
    on = [name for name, flag in (("distributed optimizer", sw.distributed_optimizer), ("full recompute", sw.recompute),
                                  ("sleeping sampler", sw.sleep)) if flag]
    if sw.offload_fraction:
        on.append(f"optimizer offload {sw.offload_fraction:g}")
    critic = []
    if (c := plan.critic_work) is not None:
        critic = ["critic (rl.advantage=gae): the actor's layers at its layout, output layer frozen (weights kept), "
                  f"a value head, its own Adam; its update after the actor's: micro-batch {c.micro_batch} x "
                  f"{c.seq_len} tokens, {c.micro_batches} per update, {c.updates} update(s)"]
    return [
        f"layout: {plan.layout.describe()} on {hw.nodes} node(s) of {hw.gpus_per_node} x {hw.gpu_memory_gib:g} GiB"
        + (f"; {', '.join(on)}" if on else ""),
        f"step: {w.sequences} sequences of {w.prompt_tokens} prompt + {w.response_tokens} response tokens; "
        f"micro-batch {w.micro_batch} x {w.seq_len} tokens, {w.micro_batches} per update, {w.updates} update(s)",
        *critic,
        f"rollout: {w.engines} engine(s) at TP{w.rollout_tp}, {s.sequences_per_engine} sequences each; batch KV cache "
        f"{s.kv_batch_bytes / GIB:.1f} GiB in all; {s.concurrency:.0%} of an engine's sequences fit at once",
    ]


_KIND_ROWS = ("params", "grads", "optimizer_states", "reference_model", "fp8_extra", "activations", "logits",
              "critic_params", "critic_grads", "critic_optimizer_states", "critic_fp8_extra", "critic_activations",
              "sampler_weights", "kv_cache", "sampler_budget", "reserve")


def _memory_lines(plan: Plan) -> list[str]:
    ranks = plan.all_ranks
    head = "memory per GPU (GiB)".ljust(34) + "".join(
        f"{('engine ' if r.pp_rank < 0 else 'rank ') + _ranks_text(r.stage_ranks):>14}" for r in ranks)
    lines = [head]
    for kind in _KIND_ROWS:
        if any(r.kinds.get(kind, 0) for r in ranks):  # critic_* only with a critic
            lines.append(f"  {kind:<32}" + "".join(f"{_gib(r.kinds.get(kind, 0)):>14}" for r in ranks))
    lines.append(f"  {'= rollout phase':<32}" + "".join(f"{_gib(r.rollout):>14}" for r in ranks))
    lines.append(f"  {'= update phase':<32}" + "".join(f"{_gib(r.update):>14}" for r in ranks))
    lines.append("  (sampler_weights and kv_cache are inside sampler_budget; the update phase "
                 + ("frees it: sleeping sampler)" if plan.switches.sleep else "keeps it: no sleep)"))
    if has_critic(plan.cfg.rl):
        lines.append("  (the critic's update runs after the actor's: the update phase holds the larger of "
                     "activations + logits and critic_activations)")
    for kind in ("optimizer_offload", "sleeping_sampler_weights", "routing_record"):
        if any(r.host[kind] for r in ranks):
            lines.append(f"  {'host: ' + kind:<32}" + "".join(f"{_gib(r.host[kind]):>14}" for r in ranks))
    for name, label in (("optimizer_replicated", "optimizer, replicated"),
                        ("optimizer_distributed", "optimizer, distributed"),
                        ("optimizer_offloaded_to_host", "optimizer, offloaded (host)"),
                        ("activations_no_recompute", "activations, no recompute"),
                        ("activations_full_recompute", "activations, full recompute")):
        lines.append(f"  {'alt: ' + label:<32}" + "".join(f"{_gib(r.variants[name]):>14}" for r in plan.ranks))
    return lines


def _verdict_lines(plan: Plan, suggestions: list[Suggestion]) -> list[str]:
    mem = plan.hw.gpu_memory_gib
    phase = lambda ok: "fits" if ok else "DOES NOT FIT"  # noqa: E731
    lines = [f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'} in {mem:g} GiB per GPU -- "
             f"rollout {plan.rollout_peak / GIB:.1f} GiB ({phase(plan.fits_rollout)}), "
             f"update {plan.update_peak / GIB:.1f} GiB ({phase(plan.fits_update)})"]
    if not plan.sampler.starts:
        lines.append(f"  the engine cannot start: weights {plan.sampler.weights_bytes / GIB:.1f} GiB + workspace "
                     f"exceed its budget of {plan.sampler.budget_bytes / GIB:.1f} GiB (gpu_memory_utilization)")
    for s in suggestions:
        p = s.plan
        lines.append(f"  fits with: {' '.join(s.changes)}  -> rollout {p.rollout_peak / GIB:.1f} GiB, "
                     f"update {p.update_peak / GIB:.1f} GiB, step ~{p.times['total']:.0f} s")
    if not plan.fits and not suggestions:
        lines.append("  no change tried makes it fit (see docs/plan.md for what is tried)")
    return lines


def _time_lines(plan: Plan) -> list[str]:
    t = plan.times
    total = t["total"]
    lines = ["time per step (s; no overlap; compute at "
             f"{plan.hw.mfu:.0%} of peak, links at {plan.hw.bandwidth_efficiency:.0%})"]
    if not math.isfinite(total):
        lines.append("  (no rollout estimate: the engine cannot start)")
    width = max(18, *(len(part) + 1 for part in t))  # the critic's parts have longer names
    for part, secs in t.items():
        if part != "total" and math.isfinite(secs):
            share = f"  {secs / total:6.1%}" if math.isfinite(total) and total else ""
            lines.append(f"  {part:<{width}}{secs:10.2f}{share}")
    if math.isfinite(total):
        lines.append(f"  {'total':<{width}}{total:10.2f}")
    lines.append("traffic per step, rank " + _ranks_text(plan.ranks[0].stage_ranks)
                 + ": " + ", ".join(f"{x.family} {x.bytes_per_rank / GB:.1f} GB ({x.link})" for x in plan.traffic[0]))
    return lines


def _grace_lines(c: CheckpointPlan) -> list[str]:
    """Whether run.stop_grace_s and the launcher's kill delay let a stopped run save its step."""
    lines = [f"  grace: a SIGTERM waits for the step in progress (up to {c.step_s:.0f} s), then "
             f"{c.stop_grace_needed_s:.0f} s to " + ("finish a save in flight and " if c.async_save else "")
             + "save the stopped step"]
    verdict = "enough" if c.stop_grace_ok else f"too short: set run.stop_grace_s={c.recommended_stop_grace_s}"
    lines.append(f"    run.stop_grace_s={c.stop_grace_s:g}: {verdict}")
    if c.kill_grace_ok:
        lines.append(f"    torchrun --shutdown-timeout / SLURM KillWait (default {LAUNCHER_KILL_S:g} s): enough")
    elif c.recommended_kill_grace_s is None:
        lines.append("    the launcher's kill delay: unknown (no step time: the engine cannot start)")
    else:
        k = c.recommended_kill_grace_s
        lines.append(f"    torchrun --shutdown-timeout / SLURM KillWait (default {LAUNCHER_KILL_S:g} s): too short: "
                     f"--shutdown-timeout {k}; under SLURM sbatch --signal=TERM@{k} (SIGTERM {k} s before the "
                     "time limit) or a preemption GraceTime of it")
    return lines


def _checkpoint_lines(plan: Plan) -> list[str]:
    """Size, save time at the stated rates, what the steps wait for, and the stop's grace."""
    c, hw = plan.checkpoint, plan.hw
    mode = ("run.async_save=true: the host copy; write and verify run beside the steps" if c.async_save
            else "run.async_save=false: the whole save")
    return [
        "checkpoint (model + optimizer state: fp32 main params and Adam's moments; docs/plan.md \"Checkpoints\")",
        f"  size: {c.total_bytes / GIB:.1f} GiB in all (weights {c.weights_bytes / GIB:.1f}, optimizer "
        f"{c.optimizer_bytes / GIB:.1f}); per node {c.node_bytes / GIB:.1f} GiB, per rank {c.rank_bytes / GIB:.1f} "
        "GiB at most (also its host copy)",
        f"  save at {hw.storage_gbps:g} GB/s per node: {c.save_s:.0f} s = host copy {c.host_copy_s:.1f} s "
        f"({hw.host_copy_gbps:g} GB/s per GPU) + write {c.write_s:.1f} s + manifest hashes {c.verify_s:.1f} s "
        f"(each rank's files read back, SHA-256 at {hw.hash_gbps:g} GB/s per rank)",
        f"  the steps wait {c.blocking_s:.1f} s per save ({mode})",
        *_grace_lines(c),
    ]


def plan_text(plan: Plan, suggestions: list[Suggestion], recipe: str) -> str:
    """The plan for reading in a terminal."""
    lines = [f"plan for {recipe}"]
    lines += [*_model_lines(plan), *_setup_lines(plan), "", *_memory_lines(plan), ""]
    lines += [*_verdict_lines(plan, suggestions), "", *_time_lines(plan), "", *_checkpoint_lines(plan)]
    return "\n".join(lines)
