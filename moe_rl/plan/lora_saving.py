"""What LoRA saves against full fine-tuning of the same recipe (`python -m moe_rl.plan` with
`model.lora.rank > 0`): the same recipe re-planned with the adapters off (`model.freeze`
kept) on the same GPUs, the gradient and optimizer bytes per GPU that LoRA removes, and
the GPUs each needs: the smallest world among the planned one times 1, 2, 4, 8 (the same
layout, more data parallelism) at which the plan fits, as planned (not searched further)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_rl.config import ConfigError
from moe_rl.plan.hardware import GIB
from moe_rl.plan.planner import Plan, make_plan

FACTORS = (1, 2, 4, 8)
"""The worlds tried for "GPUs needed": the planned one times these."""


@dataclass(frozen=True)
class LoraSaving:
    lora: Plan
    full: Plan
    """The same recipe, GPUs and switches with model.lora.rank=0."""
    lora_gpus: int | None
    """The smallest world tried at which the LoRA plan fits (None: none of them)."""
    full_gpus: int | None
    """The same for full fine-tuning."""

    @property
    def saved_bytes(self) -> int:
        """Update-phase peak per GPU: full fine-tuning's minus LoRA's."""
        return self.full.update_peak - self.lora.update_peak

    @property
    def removed_bytes(self) -> int:
        """Gradient and optimizer bytes on the busiest rank that LoRA does not hold."""
        def held(p: Plan) -> int:
            r = max(p.ranks, key=lambda r: r.update)
            return r.kinds["grads"] + r.kinds["optimizer_states"]
        return held(self.full) - held(self.lora)


def _gpus_needed(plan: Plan) -> int | None:
    for f in FACTORS:
        hw = dataclasses.replace(plan.hw, gpus=plan.hw.gpus * f)
        try:
            p = plan if f == 1 else make_plan(plan.source, hw, plan.work.prompt_tokens, plan.switches)
        except ConfigError:  # (a world the layout does not divide)
            continue
        if p.fits:
            return hw.gpus
    return None


def lora_saving(plan: Plan) -> LoraSaving | None:
    """LoRA against full fine-tuning for a LoRA `plan`; None without LoRA."""
    lora = plan.cfg.model.lora
    if not lora.enabled:
        return None
    source = plan.source.revised("model", lora=dataclasses.replace(lora, rank=0))
    full = make_plan(source, plan.hw, plan.work.prompt_tokens, plan.switches)
    return LoraSaving(plan, full, _gpus_needed(plan), _gpus_needed(full))


def saving_lines(s: LoraSaving) -> list[str]:
    """The saving in two lines of the text report."""
    lora = s.lora.cfg.model.lora
    tried = ", ".join(str(s.lora.hw.gpus * f) for f in FACTORS)
    needs = lambda gpus: str(gpus) if gpus else f"more than {s.lora.hw.gpus * FACTORS[-1]}"  # noqa: E731
    return [
        f"LoRA rank {lora.rank} ({', '.join(lora.modules)}) against full fine-tuning: removes the gradients and "
        f"optimizer states of the frozen base weights ({s.full.params_total / 1e9:.2f} B parameters), "
        f"{s.removed_bytes / GIB:.1f} GiB per GPU; update phase {s.lora.update_peak / GIB:.1f} GiB against "
        f"{s.full.update_peak / GIB:.1f} GiB per GPU ({s.saved_bytes / GIB:.1f} GiB per GPU saved)",
        f"  GPUs needed at {s.lora.hw.gpu_memory_gib:g} GiB each (this layout, more data parallelism; tried "
        f"{tried}): LoRA {needs(s.lora_gpus)}, full fine-tuning {needs(s.full_gpus)}",
    ]


def saving_dict(s: LoraSaving) -> dict[str, int | None]:
    """The saving as plain data (`--json`'s `lora_saving`), bytes."""
    return {"lora_update_peak_bytes": s.lora.update_peak, "full_update_peak_bytes": s.full.update_peak,
            "saved_bytes": s.saved_bytes, "removed_bytes": s.removed_bytes, "lora_gpus": s.lora_gpus,
            "full_gpus": s.full_gpus}
