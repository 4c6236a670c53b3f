"""`--check`: the whole run checked for a world size, without building anything, and the
one line that says what would run.

    python -m moe_rl.train --check --nproc 256 --config examples/gpu/deepseek_v3.yaml
    # recipe OK: rspo, 256 ranks (TP8 PP1 EP256 DP32), model 61 layers x 256 experts (top-8) from /models/x, ...

The launch scripts run it once before torchrun, so a bad recipe is this one line rather
than one error per rank under torchrun's own traceback.
"""

from __future__ import annotations

from moe_rl.config import Config, validate_layout


def summary(cfg: Config, world: int, *, sft: bool = False) -> str:
    """What would run, in one line (the layout, the model, where it starts and writes)."""
    p, m = cfg.parallel, cfg.model
    dp = validate_layout(cfg, world)
    layout = (f"{world} rank{'s' if world > 1 else ''} (TP{p.tensor_model_parallel_size} "
              f"PP{p.pipeline_model_parallel_size} EP{p.expert_model_parallel_size} DP{dp})")
    start = cfg.run.init_checkpoint or "random init"
    model = f"model {m.num_layers} layers x {m.num_experts} experts (top-{m.moe_router_topk}) from {start}"
    if sft:
        out = cfg.sft.output or cfg.run_dir / "base"
        return f"sft, {layout}, {model}, up to {cfg.run.steps} steps -> {out}"
    return f"{cfg.rl.objective}, {layout}, {model}, {cfg.run.steps} steps -> {cfg.run_dir}"


def check_recipe(cfg: Config, world: int, *, sft: bool = False) -> str:
    """Run every pre-flight check for `world` ranks (raises ConfigError) and return `summary`."""
    from moe_rl.preflight import check_run

    check_run(cfg, world, sft=sft)
    return summary(cfg, world, sft=sft)
