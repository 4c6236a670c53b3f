"""The dry-run planner: does a recipe fit on its GPUs, and where does a step's time go.

    python -m moe_rl.plan --config examples/gpu/qwen3_30b_a3b.yaml --gpus 16 [--json]

Modules, one idea each: `model_source` (recipe or config.json), `workload` (the step's
shapes), `activations` (the activation formula), `sampler` (engine weights and KV cache),
`model_state` (parameter, gradient and optimizer bytes from megatron's buffers), `critic`
(PPO's value model under `rl.advantage: gae`, derived from the actor's), `memory` (per-rank
memory by kind and phase), `comms` (bytes per collective family),
`timing` (FLOPs and seconds), `checkpoint` (a checkpoint's size, save time and the stop's
grace), `planner` (the recipe resolved and checked, and one plan from megatron's
meta-device builds, `moe_rl.learner.meta`), `verdict` (changes that make it fit, re-planned), `report`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Lazy: the package imports megatron-core (through the meta-device build), and
# `python -m moe_rl.plan` first silences the import-time warnings of the GPU stacks.
_EXPORTS = {
    "Hardware": "moe_rl.plan.hardware",
    "ModelSource": "moe_rl.plan.planner",
    "resolve_model": "moe_rl.plan.planner",
    "Plan": "moe_rl.plan.planner",
    "make_plan": "moe_rl.plan.planner",
    "Switches": "moe_rl.plan.memory",
    "Suggestion": "moe_rl.plan.verdict",
    "suggest": "moe_rl.plan.verdict",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_rl.plan' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
