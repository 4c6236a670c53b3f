"""What one mismatch measurement compares: a sampler (backend, precision) against the
learner (precision, parallel layout). Pure parsing, no engines (`sampler_engine` builds the
engine's typed config, the same one the trainer builds).

    Setting.parse("vllm:bf16/learner:fp32@ep2")
    # sampler: vLLM in bf16; learner: megatron in fp32 at expert parallel 2 (2 processes)

Grammar: `BACKEND:PRECISION[/learner:PRECISION][@LAYOUT]`.
  BACKEND    vllm | transformers
  PRECISION  sampler: fp32 | bf16 | fp8_emulated | fp8 (vLLM's fp8 kernels, GPU);  learner: fp32 | bf16
  LAYOUT     "1" (one process) or size tokens joined by "-": tp2, pp2, ep2, etp2
             (e.g. "tp2-ep2"); the learner then runs under torchrun with the fewest
             processes that hold the layout.
The canonical name (`Setting.name`) leaves out a "1" layout: `vllm:bf16/learner:fp32`.

fp8_emulated is an emulation (weights rounded through float8_e4m3fn, bf16 compute; see
`moe_rl/sampler/precision.py`), never fp8 execution.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from moe_rl.config import ParallelConfig, RLConfig, SamplerConfig
from moe_rl.sampler import BACKENDS as SAMPLER_BACKENDS
from moe_rl.sampler import PRECISIONS as SAMPLER_PRECISIONS
from moe_rl.sampler import EngineConfig, VLLMEngineConfig, engine_config

if TYPE_CHECKING:
    from moe_rl.config.sections import SamplerBackend, SamplerPrecision

LEARNER_PRECISIONS = ("fp32", "bf16")
SWEEP_PRECISIONS = ("fp32", "bf16", "fp8_emulated")  # what --sweep puts against the learner (any machine)

_LAYOUT_TOKEN = re.compile(r"^(tp|pp|ep|etp)([1-9][0-9]*)$")


class MeasureError(ValueError):
    """Input the mismatch tool cannot measure; the message names the file, line or flag."""


@dataclass(frozen=True)
class ScoringLayout:
    """The megatron model-parallel sizes a setting's learner scores at; data parallel takes
    the remaining processes."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("etp", self.etp)) if v > 1]
        return "-".join(parts) or "1"

    @property
    def nproc(self) -> int:
        """The fewest processes that hold the layout: world must be divisible by tp*pp
        (dense part) and by etp*ep*pp (experts), see `config.validate_layout`."""
        return math.lcm(self.tp * self.pp, self.etp * self.ep * self.pp)

    def parallel_config(self, base: ParallelConfig) -> ParallelConfig:
        """`base` (micro-batch size, backend) with this layout's sizes."""
        return dataclasses.replace(
            base,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            sequence_parallel=None,  # on under TP, as megatron needs for MoE
        )

    @staticmethod
    def parse(text: str) -> ScoringLayout:
        t = text.strip().lower()
        if t in ("1", ""):
            return ScoringLayout()
        sizes: dict[str, int] = {}
        for tok in t.split("-"):
            m = _LAYOUT_TOKEN.match(tok)
            if m is None or m.group(1) in sizes:
                raise MeasureError(
                    f"bad learner layout {text!r}: use '1' or tokens like tp2, pp2, ep2, etp2 joined by '-' "
                    "(each at most once), e.g. 'ep2' or 'tp2-ep2'"
                )
            sizes[m.group(1)] = int(m.group(2))
        return ScoringLayout(**sizes)


@dataclass(frozen=True)
class Setting:
    """One row of the report: this sampler's rollouts scored by this learner."""

    backend: str
    sampler_precision: str
    learner_precision: str = "fp32"
    layout: ScoringLayout = field(default_factory=ScoringLayout)
    top_p: float = 1.0
    """The sampler's nucleus: below 1 the sampler's log-prob is that of the truncated,
    renormalized distribution it sampled from, while the learner scores the full softmax
    (what RL training refuses: this row shows the bias it would bring)."""

    def __post_init__(self) -> None:
        for what, value, allowed in (
            ("sampler backend", self.backend, SAMPLER_BACKENDS),
            ("sampler precision", self.sampler_precision, SAMPLER_PRECISIONS),
            ("learner precision", self.learner_precision, LEARNER_PRECISIONS),
        ):
            if value not in allowed:
                raise MeasureError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
        if not 0 < self.top_p <= 1:
            raise MeasureError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sampler_precision == "fp8" and self.backend != "vllm":
            raise MeasureError("sampler precision fp8 is vLLM's fp8 execution (GPU); the transformers "
                               "sampler has fp8_emulated")

    @property
    def sampler(self) -> tuple[str, str, float]:
        """(backend, precision, top_p): settings that share it share one set of rollouts."""
        return self.backend, self.sampler_precision, self.top_p

    @property
    def sampler_name(self) -> str:
        nucleus = "" if self.top_p == 1 else f"(top_p={self.top_p:g})"
        return f"{self.backend}:{self.sampler_precision}{nucleus}"

    @property
    def name(self) -> str:
        at = "" if self.layout.name == "1" else f"@{self.layout.name}"
        return f"{self.sampler_name}/learner:{self.learner_precision}{at}"

    @staticmethod
    def parse(text: str, default_layout: ScoringLayout | None = None, default_learner: str = "fp32") -> Setting:
        """`BACKEND:PRECISION[/learner:PRECISION][@LAYOUT]` (module docstring); the parts left
        out take `default_learner` and `default_layout`."""
        body, _, layout = text.strip().partition("@")
        sampler, _, learner = body.partition("/")
        backend, colon, precision = sampler.partition(":")
        if not colon or (learner and not learner.startswith("learner:")):
            raise MeasureError(
                f"bad setting {text!r}: expected BACKEND:PRECISION[/learner:PRECISION][@LAYOUT], "
                "e.g. vllm:bf16/learner:fp32@ep2"
            )
        return Setting(
            backend=backend.strip(),
            sampler_precision=precision.strip(),
            learner_precision=learner.removeprefix("learner:").strip() or default_learner,
            layout=ScoringLayout.parse(layout) if layout else (default_layout or ScoringLayout()),
        )


def sweep_settings(backend: str, learner_precision: str, layouts: list[ScoringLayout]) -> list[Setting]:
    """--sweep: every sampler precision against one learner precision, at each layout."""
    return [Setting(backend, p, learner_precision, lay) for lay in layouts for p in SWEEP_PRECISIONS]


def check_unique(settings: list[Setting]) -> None:
    names = [s.name for s in settings]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MeasureError(f"setting(s) given twice: {', '.join(dup)}")
    if not settings:
        raise MeasureError("no settings to measure")


def sampler_engine(sampler: SamplerConfig, rl: RLConfig, backend: str, precision: str, seed: int,
                   eos_token_ids: list[int]) -> EngineConfig:
    """The engine of one measured sampler: the checkpoint's sampler section (`sampler`, with
    its `rl`) with this backend and precision, through `moe_rl.sampler.engine_config` (what
    the trainer runs), as one in-process engine; vLLM captures routed experts where it can (a
    GPU: the routing comparison) and shows no load progress bar of its own (one bar: the tool's)."""
    # (backend and precision: one of the sampler's BACKENDS and PRECISIONS, Setting's check)
    sampler = dataclasses.replace(sampler, backend=cast("SamplerBackend", backend),
                                  precision=cast("SamplerPrecision", precision), in_process=True,
                                  tensor_parallel_size=1, expert_parallel=False, sleep_between_steps=False)
    engine = engine_config(sampler, rl, seed, eos_token_ids, routed_experts=torch.cuda.is_available())
    if isinstance(engine, VLLMEngineConfig):
        engine = dataclasses.replace(engine, show_load_progress=False)
    return engine
