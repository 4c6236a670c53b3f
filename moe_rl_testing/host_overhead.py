"""The learner's host overhead, counted on a CPU: one trainer step (score, then one update)
per routing setting, every aten op and would-be device wait charged to the frame that made it
(`op_counter.OpCounter`), and the sums read back from the counts. Measured by
bench/cpu/bench_host_overhead.py (its tables) and checked by
tests/unit/learner/test_host_overhead.py (no wait inside a micro-batch)."""

from __future__ import annotations

from typing import Any

import torch

LINES = 40
"""Source lines kept per pass in the results: where the project's ops in a micro-batch are made."""
SETTINGS = {
    "plain": ["rl.objective=grpo", "rl.capture_routing=false"],
    "capture": ["rl.objective=grpo", "rl.capture_routing=true"],  # (the default)
    "router shift (rspo)": ["rl.objective=rspo"],
    "R2": ["rl.objective=grpo", "rl.replay=R2"],
    "R3": ["rl.objective=grpo", "rl.replay=R3"],
}
FULL = {"layers": 4, "hidden": 128, "experts": 128, "topk": 8, "ffn": 64, "vocab": 512, "rows": 16, "mbs": 8,
        "prompt": (16, 32), "response": (16, 48)}
QUICK = {"layers": 2, "hidden": 64, "experts": 8, "topk": 2, "ffn": 32, "vocab": 128, "rows": 8, "mbs": 4,
         "prompt": (4, 8), "response": (2, 8)}


def model_overrides(shape: dict[str, Any]) -> list[str]:
    return [f"model.num_layers={shape['layers']}", f"model.hidden_size={shape['hidden']}",
            "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=32",
            f"model.num_experts={shape['experts']}", f"model.moe_router_topk={shape['topk']}",
            f"model.moe_ffn_hidden_size={shape['ffn']}", f"model.vocab_size={shape['vocab']}",
            "model.max_position_embeddings=128", f"parallel.micro_batch_size={shape['mbs']}"]


def step_batch(shape: dict[str, Any], num_layers: int, seed: int = 0) -> Any:
    """A step's rows with advantages and the sampler's routing (R3 replays it)."""
    from moe_rl.batch import TokenBatch
    from moe_rl.routing.record import ReplayIds, ids_dtype
    from moe_rl.step_batch import StepBatch

    g = torch.Generator().manual_seed(seed)
    R, V, E, K = shape["rows"], shape["vocab"], shape["experts"], shape["topk"]

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(4, V, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts = [draw(*shape["prompt"]) for _ in range(R)]
    responses = [draw(*shape["response"]) for _ in range(R)]
    tokens = TokenBatch.from_lists(prompts, responses, response_width=shape["response"][1])
    S = tokens.seq_len
    ids = torch.rand(R, S, num_layers, E, generator=g).argsort(-1)[..., :K].sort(-1).values.to(ids_dtype(E))
    valid = torch.arange(S)[None, :] < (tokens.total_lens_B - 1)[:, None]  # vLLM never routes the last token
    sampler = ReplayIds(torch.arange(R), ids, valid)
    return StepBatch.whole(tokens, adv_B=torch.randn(R, generator=g), sampler_routing=sampler)


def run_step(learner: Any, cfg: Any, batch: Any, counted: bool) -> dict[str, Any]:
    """The trainer's off-policy step: score (old logprobs, routing record), then one update."""
    from moe_rl_testing.op_counter import OpCounter

    try:
        from moe_rl.programs.rl.policy_loss import PolicyLossFn
    except ImportError:  # (a baseline tree from before round 4's layout)
        from moe_rl.update import PolicyLossFn

    out: dict[str, Any] = {}
    rl = cfg.rl
    plan = learner.routing_plan(rl.replay, batch, capture=rl.records_routing)
    with OpCounter(learner) if counted else _Null() as c:
        score = learner.score(batch, plan, cfg.sampler.temperature)
    out["score"] = summarize(c)
    scored = batch.scored(score.logp_BT, score.record)
    plan = learner.routing_plan(rl.replay, scored, capture=rl.records_routing)
    loss_fn = PolicyLossFn(cfg.rl, cfg.sampler.max_new_tokens)
    with OpCounter(learner) if counted else _Null() as c:
        learner.update(scored, loss_fn, plan, cfg.sampler.temperature)
    out["update"] = summarize(c)
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def summarize(c: Any) -> dict[str, Any]:
    if c is None:
        return {}
    return {"microbatches": c.microbatches,
            "counts": {"|".join(k): v for k, v in sorted(c.counts.items())},
            "syncs": [{"region": r, "who": who, "where": w, "what": what, "count": n}
                      for (r, who, w, what), n in sorted(c.syncs.items())],
            "mixed": [f"{op} at {w}: {n}" for (op, w), n in sorted(c.mixed.items())],
            "project_lines": dict([(f"{k}|{w}", n) for (r, k, w), n in c.lines.most_common() if r == "mb"][:LINES])}


def measure(shape: dict[str, Any], settings: dict[str, list[str]] = SETTINGS, warmup: bool = True) -> dict[str, Any]:
    """Counts of one step per setting (run inside a learner process group), after an
    uncounted step (`warmup`: the optimizer's states and megatron's caches exist by then)."""
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, parallel_layout

    base = model_overrides(shape)
    results: dict[str, Any] = {}
    with parallel_layout(load_config(None, base).parallel, seed=0) as layout:
        torch.manual_seed(0)
        cfg0 = load_config(None, base)
        learner = Learner(cfg0.model, cfg0.parallel, layout, optimizer=cfg0.optimizer, total_updates=100)
        batch = step_batch(shape, len(learner.taps.layers))
        for name, overrides in settings.items():
            cfg = load_config(None, base + overrides)
            if warmup:
                run_step(learner, cfg, batch, counted=False)
            results[name] = run_step(learner, cfg, batch, counted=True)
    return results


# ---------------------------------------------------------------------- reading the counts

def total(summary: dict[str, Any], kind: str, *, region: str | None = None, owner: str | None = None,
          area: str | None = None, gpu_path: bool = True) -> int:
    """Sum of the counts of one kind; `gpu_path`: without the CPU-only project areas."""
    from moe_rl_testing.op_counter import CPU_ONLY_AREAS

    n = 0
    for key, v in summary["counts"].items():
        r, o, a, k = key.split("|")
        if k != kind or (region and r != region) or (owner and o != owner) or (area and a != area):
            continue
        if gpu_path and a in CPU_ONLY_AREAS:
            continue
        n += v
    return n


def per_mb(summary: dict[str, Any], kind: str, owner: str, area: str | None = None) -> float:
    """Per micro-batch (one area's, or the GPU path's: without the CPU-only areas)."""
    count = total(summary, kind, region="mb", owner=owner, area=area, gpu_path=area is None)
    return count / max(summary["microbatches"], 1)
