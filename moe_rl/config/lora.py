"""`model.lora` and `model.freeze`: low-rank adapters on the learner's linear layers, and
parameter groups that do not train (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.errors import ConfigError

LORA_MODULES = ("attention", "experts", "shared_experts", "dense_mlp")
"""What `model.lora.modules` may list."""

FREEZE_GROUPS = ("router", "embeddings", "output_head", "attention", "experts")
"""What `model.freeze` may list."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters: every adapted linear computes y = W x + (alpha / rank) B A x, with
    W frozen and only A and B trained (B starts at zero, so training starts from the base)."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (every parameter trains, as without this section)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1). 0 (the default) keeps the scoring and the
    update passes identical, which the on-policy ratio of RL wants."""
    modules: tuple[str, ...] = ("attention", "experts")
    """Where adapters sit: attention (q/k/v and output projections; MLA's projections),
    experts (every routed expert's fused gate+up and down projections, each expert its own
    adapters), shared_experts, dense_mlp (the leading dense layers' MLP)."""

    @property
    def enabled(self) -> bool:
        """Adapters are on (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank (0 when off)."""
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, key: str = "model.lora") -> None:
        """Ranges and module names (ConfigError naming the key)."""
        if self.rank < 0:
            raise ConfigError(f"{key}.rank must be >= 0 (0: off), got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{key}.dropout must be in [0, 1), got {self.dropout}")
        if self.alpha <= 0:
            raise ConfigError(f"{key}.alpha must be > 0, got {self.alpha}")
        for name in self.modules:
            if name not in LORA_MODULES:
                raise ConfigError(f"{key}.modules: unknown module {name!r}; valid: {', '.join(LORA_MODULES)}")
        if self.enabled and not self.modules:
            raise ConfigError(f"{key}.modules is empty with {key}.rank={self.rank}: list at least one of "
                              f"{', '.join(LORA_MODULES)}, or set {key}.rank=0")
        if len(set(self.modules)) != len(self.modules):
            raise ConfigError(f"{key}.modules lists a module twice: {list(self.modules)}")


def validate_freeze(freeze: tuple[str, ...], lora: LoraConfig | None = None, key: str = "model.freeze") -> None:
    """`model.freeze` names known groups, each once, and leaves some adapter of `lora` training."""
    if lora is not None and lora.enabled and all(m in freeze for m in lora.modules):
        raise ConfigError(f"{key}={list(freeze)} freezes every adapter of model.lora.modules={list(lora.modules)}: "
                          "nothing would train; drop a group from model.freeze or adapt another module")
    for name in freeze:
        if name not in FREEZE_GROUPS:
            raise ConfigError(f"{key}: unknown group {name!r}; valid: {', '.join(FREEZE_GROUPS)}")
    if len(set(freeze)) != len(freeze):
        raise ConfigError(f"{key} lists a group twice: {list(freeze)}")
