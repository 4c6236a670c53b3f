"""`--check`: the whole run checked for a world size, without building anything, and the
one line that says what would run.

    python -m moe_rl.train --check --nproc 256 --config examples/gpu/deepseek_v3.yaml
    # recipe OK: rspo, 256 ranks (TP8 PP1 EP256 DP32), model 61 layers x 256 experts (top-8) from /models/x, ...

Each program's `Program.check` runs its checks and returns its line, built from the pieces
here. The launch scripts run it once before torchrun, so a bad recipe is this one line
rather than one error per rank under torchrun's own traceback.
"""

from __future__ import annotations

from moe_rl.config import Config, validate_layout


def layout_line(cfg: Config, world: int) -> str:
    """'N ranks (TPx PPx EPx DPx), model L layers x E experts (top-k) from START'."""
    p, m = cfg.parallel, cfg.model
    dp = validate_layout(cfg, world)
    layout = (f"{world} rank{'s' if world > 1 else ''} (TP{p.tensor_model_parallel_size} "
              f"PP{p.pipeline_model_parallel_size} EP{p.expert_model_parallel_size} DP{dp})")
    start = cfg.run.init_checkpoint or "random init"
    return f"{layout}, model {m.num_layers} layers x {m.num_experts} experts (top-{m.moe_router_topk}) from {start}"


def check_rl_recipe(cfg: Config, world: int) -> str:
    """The RL program's `--check`: every pre-flight check for `world` ranks (raises
    ConfigError), then what would run."""
    from moe_rl.preflight import check_run

    check_run(cfg, world)
    return f"{cfg.rl.objective}, {layout_line(cfg, world)}, {cfg.run.steps} steps -> {cfg.run_dir}"
