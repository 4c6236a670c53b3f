"""What fits on N H100s: for each published model and GPU count, every layout the planner
can build is planned (distributed optimizer and a sleeping sampler on; with and without the
optimizer offloaded; every rollout TP, with vLLM's budget sized to what the learner leaves),
with and without full recompute (its extra forward is in the step time), and the fastest one
that fits is reported. This is how docs/plan.md's table is made:

    python -m moe_rl.plan.table --config examples/gpu/qwen3_30b_a3b.yaml --gpus 8 16 64 \\
        --models-dir /tmp/plan_models > /tmp/table.md

The step is the recipe's (prompts, G, response length, precision), with any `section.key=value`
overrides (`rl.advantage=gae`: PPO, the actor and its critic on the same GPUs; `--models`
restricts the rows); `--models-dir` receives the published config.json files
(`moe_rl.plan.published`), which is all a plan needs.
DeepSeek-V3 and Kimi-K2 are left out: they need hundreds of GPUs (PP=1, since their 61
layers do not split into equal stages), so every cell of these GPU counts would read "does
not fit"; examples/gpu/deepseek_v3.yaml states their plans.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import sys
from collections.abc import Iterator

from moe_rl.cli import cpu_environment, run_guarded
from moe_rl.config import ConfigError, ModelConfig, load_recipe
from moe_rl.plan.critic import has_critic
from moe_rl.plan.hardware import GIB, Hardware
from moe_rl.plan.memory import Switches
from moe_rl.plan.published import CONFIGS, write_config_dir

TABLE_MODELS = tuple(name for name in CONFIGS if name not in ("DeepSeek-V3", "Kimi-K2"))
"""The published models the table plans (why not DeepSeek-V3 and Kimi-K2: module docstring)."""


def layouts(model: ModelConfig, gpus: int, per_node: int) -> Iterator[tuple[int, int, int]]:
    """(TP, EP, PP) the learner can run at `gpus`: TP inside a node dividing the KV heads,
    EP from 8 up dividing the experts, PP dividing the layers."""
    m = model
    for pp in (1, 2, 4):
        if m.num_layers % pp or gpus % pp:
            continue
        for tp in (1, 2, 4, 8):
            if tp > per_node or m.num_query_groups % tp or (gpus // pp) % tp:
                continue
            for ep in (8, 16, 32, 64):
                if m.num_experts % ep == 0 and (gpus // pp) % ep == 0:
                    yield tp, ep, pp


def _fitted(source, hw: Hardware, prompt_tokens: int, sw: Switches):  # (ModelSource, ...) -> Plan | None
    """The fastest plan of `source` (`moe_rl.plan.planner.ModelSource`) over rollout TPs, vLLM's
    budget set to the room the learner leaves (less 1%), among those whose engine starts."""
    from moe_rl.plan.planner import make_plan
    from moe_rl.plan.verdict import engine_host_load

    best, rtp = None, 1
    while rtp <= hw.gpus:
        trial = source.revised("sampler", tensor_parallel_size=rtp)
        rtp *= 2
        try:
            first = make_plan(trial, hw, prompt_tokens, sw)
        except ConfigError:
            continue
        room = hw.gpu_memory_bytes - engine_host_load(first)
        util = min(0.9, math.floor(room / hw.gpu_memory_bytes * 100) / 100 - 0.01)
        if util <= 0:
            continue
        plan = make_plan(trial.revised("sampler", gpu_memory_utilization=util), hw, prompt_tokens, sw)
        if plan.fits and plan.sampler.concurrency > 0 and (best is None or plan.times["total"] < best.times["total"]):
            best = plan
    return best


def best_plan(source, hw: Hardware, prompt_tokens: int):  # (ModelSource, ...) -> Plan | None
    """The fastest plan that fits over `layouts`, with and without the optimizer offloaded to
    host memory and with and without full recompute (whose extra forward the step time counts)."""
    best = None
    for tp, ep, pp in layouts(source.cfg.model, hw.gpus, hw.gpus_per_node):
        laid_out = source.revised("parallel", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                  pipeline_model_parallel_size=pp, micro_batch_size=1)
        for recompute, offload in itertools.product((False, True), (0.0, 1.0)):
            sw = Switches(distributed_optimizer=True, offload_fraction=offload, recompute=recompute, sleep=True)
            plan = _fitted(laid_out, hw, prompt_tokens, sw)
            if plan and (best is None or plan.times["total"] < best.times["total"]):
                best = plan
    return best


def cell(plan) -> str:
    if plan is None:
        return "does not fit"
    lay, w = plan.layout, plan.work
    layout = f"TP{lay.tp}·EP{lay.ep}" + (f"·PP{lay.pp}" if lay.pp > 1 else "")
    parts = sorted(((v, k) for k, v in plan.times.items() if k != "total"), reverse=True)
    top = parts[0][1].replace("rollout_decode", "decode").replace("update_compute", "update")
    extra = (", recompute" if plan.switches.recompute else "") + (", offload" if plan.switches.offload_fraction else "")
    return (f"{layout}, rollout TP{w.rollout_tp}{extra}: update {plan.update_peak / GIB:.0f} GiB, "
            f"KV for {plan.sampler.concurrency:.0%}; ~{plan.times['total']:.0f} s/step "
            f"({top} {parts[0][0] / plan.times['total']:.0%})")


def main(argv: list[str] | None = None) -> None:
    cpu_environment()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(prog="python -m moe_rl.plan.table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe whose RL step is planned")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides of the recipe")
    ap.add_argument("--models", nargs="+", choices=TABLE_MODELS, default=list(TABLE_MODELS),
                    help="the published models to plan (default: all)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--models-dir", required=True, help="where to write the published config.json files")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    args = ap.parse_intermixed_args(argv)  # overrides may sit between the flags
    sys.exit(run_guarded("python -m moe_rl.plan.table", lambda: _table(args)))


def _table(args: argparse.Namespace) -> int:
    """Print the table, a row as soon as it is planned (a bad recipe: ConfigError)."""
    from moe_rl.plan.planner import resolve_model

    rows: list[str] = []
    for name in args.models:
        directory = write_config_dir(name, f"{args.models_dir}/{name}")
        source = resolve_model(load_recipe(args.config, [f"run.init_checkpoint={directory}", *args.overrides])[0])
        if not rows:
            what = "model (PPO: actor + critic)" if has_critic(source.cfg.rl) else "model"
            rows += [f"| {what} | " + " | ".join(f"{g} x H100" for g in args.gpus) + " |",
                     "|---|" + "---|" * len(args.gpus)]
        cells = [cell(best_plan(source, Hardware(gpus=g), args.prompt_tokens)) for g in args.gpus]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    main()
