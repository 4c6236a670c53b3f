"""The learner's optimizer and learning-rate schedule (megatron-core's own), from an
optimizer section (the actor's `optimizer` or PPO's `critic.optimizer`: one type).
What this device cannot run (bf16 training or the distributed optimizer without CUDA) was
refused by `moe_rl.preflight.check_learner_device` before anything was built."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from moe_rl.config import OptimizerConfig


def build_optimizer(o: OptimizerConfig, model: torch.nn.Module, total_updates: int, *,
                    bf16: bool) -> tuple[Any, OptimizerParamScheduler]:
    """Adam (section `o`) over `model`'s parameters and its schedule over `total_updates`
    optimizer steps (linear warm-up, then `o.lr_decay_style` down to `o.min_lr`); `bf16`:
    the model's parameters are bf16 (fp32 main copies in the optimizer)."""
    optimizer = get_megatron_optimizer(
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
        [model],
    )
    warmup = min(o.lr_warmup_steps, max(total_updates - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer,
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
    return optimizer, scheduler


def schedule_kept_note(saved: dict, scheduler: OptimizerParamScheduler) -> str | None:
    """What a resume that changed the run's length does to a decaying schedule, in a line
    (None when nothing changes): the saved schedule continues, because stretching it to the
    new length would raise the learning rate mid-decay. megatron-core loads the saved one."""
    steps = (saved.get("lr_warmup_steps"), saved.get("lr_decay_steps"))
    if scheduler.lr_decay_style == "constant" or steps == (scheduler.lr_warmup_steps, scheduler.lr_decay_steps):
        return None
    return (f"the learning rate keeps its saved schedule ({saved.get('lr_decay_style')} decay over "
            f"{steps[1]} updates after {steps[0]} of warm-up, at update {saved.get('num_steps')}), not the "
            f"{scheduler.lr_decay_steps} this run.steps would give: it stays at min_lr past the saved end; "
            "to decay over the new length, start a new run (another run.name) from this checkpoint (run.init_checkpoint)")
