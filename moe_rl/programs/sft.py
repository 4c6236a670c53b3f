"""The supervised warm start as a program of the run loop: a random (or given) tiny MoE ->
a base policy with partial success.

Each step draws `sft.batch_size` problems from the task (a pure function of run.seed and
the step, so a resumed run draws what the uninterrupted one would) and minimises the
token-mean negative log-likelihood of the reference completion (+ EOS) given the prompt,
on the same megatron learner the RL program uses. The prompt becomes ids as the RL
sampler's prompts do (`PromptEncoder`: a Hugging Face checkpoint's chat template and
system prompt), so the policy learns the completion after the prompt it will be sampled
from. Every `run.eval_every` steps (and before step 1) it measures the expected
exact-match reward of sampling at temperature 1 on a fixed held-out set,
mean_i exp(sum_t log pi(answer_it)), which is exactly the reward RL starts from
(`eval/expected_reward`), and stops once it reaches `sft.target_reward`. The run
directory is every program's (metrics.jsonl, TensorBoard, checkpoints with the
optimizer, `run.resume=true`, Ctrl-C saves); at the end the model alone (no optimizer
state) is written to `sft.output` (default `<run>/base`; an existing checkpoint there is
replaced once the new one is complete; any other existing directory is refused), and a run
that started from a Hugging Face directory also exports it as `<run>/hf` (`run.export_hf`),
the directory the Hugging Face recipes take as run.init_checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    SFTConfig,
    to_dict,
)
from moe_rl.loop import Program
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem, Task
from moe_rl.tokenization.turns import encode_conversations

if TYPE_CHECKING:
    from moe_rl.learner.checkpoint import PendingSave
    from moe_rl.learner.protocols import PolicyLearner
    from moe_rl.tokenization.prompts import PromptEncoder

log = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 1_000_003
"""The held-out problems are drawn from run.seed + this (apart from every step's draw)."""


def encode_problems(problems: list[Problem], task: Task, encoder: PromptEncoder, seq_multiple: int,
                    rng: np.random.Generator | None = None) -> TokenBatch:
    """Prompt ids (`encoder`: the run's `PromptEncoder`) + reference completion ids (ending
    in EOS) for each problem; for a task with tools (`sft_conversation`), a whole tool-calling
    conversation per problem drawn with `rng` (None: the task's reference one), its tool
    results marked as observations (not trained on)."""
    if hasattr(task, "sft_conversation"):
        return encode_conversations([task.sft_conversation(p, rng) for p in problems], task, encoder, seq_multiple)

    pairs = [encoder.encode_example(p, task.completion(p)) for p in problems]
    return TokenBatch.from_lists([a for a, _ in pairs], [b for _, b in pairs], pad_id=encoder.tokenizer.pad_id,
                                 seq_multiple=seq_multiple)


def nll_loss(batch: TokenBatch):
    """Token-mean NLL with the whole batch's token count as normaliser (micro-batch sums
    add up to the whole-batch loss)."""
    from moe_rl.learner import MicroBatchLoss

    total = batch.response_mask().sum().clamp(min=1)  # (the policy's tokens: a conversation's tool results are not)

    def loss_fn(logp_BT: torch.Tensor, mb) -> MicroBatchLoss:
        mask = mb.batch.response_mask()
        nll = -(logp_BT * mask).sum()
        n = mask.sum()
        return MicroBatchLoss(nll / total, {"nll": nll / n.clamp(min=1)}, weight=n)

    return loss_fn


def expected_reward(learner: PolicyLearner, batch: TokenBatch) -> float:
    """mean_i exp(sum_t log pi(y_it)) at temperature 1: the exact-match reward of sampling."""
    logp = learner.logprobs(batch)
    seq = (logp * batch.response_mask()).sum(-1)
    return float(torch.exp(seq).mean())


def sft_output(sft: SFTConfig, run: RunConfig) -> Path:
    """Where the finished run's model-only checkpoint goes."""
    return Path(sft.output) if sft.output else run.run_dir / "base"


def check_output(sft: SFTConfig, run: RunConfig) -> None:
    """sft.output is replaced at the end only when it is a checkpoint (or absent / empty):
    refuse anything else before training rather than after."""
    from moe_rl.checkpoints.directories import is_checkpoint

    out = sft_output(sft, run)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"sft.output={out} is a file; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not is_checkpoint(out):
        raise ConfigError(f"sft.output={out} exists and is not a moe_rl checkpoint (it would be replaced); "
                          "choose another path")


def started_from_hf(run: RunConfig) -> bool:
    """run.init_checkpoint is a Hugging Face directory: the next program (a Hugging Face
    recipe) takes the run's export, `<run>/hf`; the project's own models go on from the
    moe_rl checkpoint `sft.output`."""
    init = run.init_checkpoint
    return bool(init) and (Path(init) / "config.json").is_file()


class SFTProgram(Program):
    """One supervised run: the learner, the task, the held-out problems."""

    name = "sft"
    evaluates_at_start = True
    needs_init_weights = False

    @classmethod
    def check(cls, cfg: Config, world: int) -> str:
        """The layout, the starting weights if any, the task's inputs with their reference
        completions, the model, the device and the output; the `--check` line."""
        from moe_rl.config import validate_layout
        from moe_rl.preflight import check_start, layout_line

        validate_layout(cfg, world)
        check_start(cfg, init_required=False, completions=True)
        check_output(cfg.sft, cfg.run)
        out = cfg.sft.output or cfg.run_dir / "base"
        return f"sft, {layout_line(cfg, world)}, up to {cfg.run.steps} steps -> {out}"

    @classmethod
    def build(cls, cfg: Config) -> Program:
        """The program from the recipe's sections, after every check (once, before anything
        is built)."""
        from moe_rl.learner import init_distributed
        from moe_rl.preflight import load_prompt_encoder

        cls.check(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        rank, world = init_distributed(cfg.parallel.distributed_backend)
        return cls(make_task(cfg.task), load_prompt_encoder(cfg)[1], rank, world, model=cfg.model,
                   parallel=cfg.parallel, optimizer=cfg.optimizer, sft=cfg.sft, run=cfg.run, recipe=to_dict(cfg))

    def __init__(self, task: Task, encoder: PromptEncoder, rank: int, world: int, *, model: ModelConfig,
                 parallel: ParallelConfig, optimizer: OptimizerConfig, sft: SFTConfig, run: RunConfig,
                 recipe: Mapping[str, Any]) -> None:
        """`encoder`: the run's `PromptEncoder`; `recipe`: the resolved recipe's plain data,
        saved with every checkpoint."""
        self.task, self.encoder, self.rank, self.world = task, encoder, rank, world
        self.model_cfg, self.parallel, self.optimizer, self.sft, self.run = model, parallel, optimizer, sft, run
        self.recipe = recipe
        self.output = sft_output(sft, run)
        self._stack = contextlib.ExitStack()
        self._evaluated: tuple[int, float] | None = None
        """(step, expected reward) of the latest evaluation."""

    def setup(self, resume_from: Path | None) -> int:
        from moe_rl.learner import Learner, load_checkpoint, load_start, parallel_layout

        run = self.run
        self.layout = self._stack.enter_context(parallel_layout(self.parallel, seed=run.seed))
        self.layout_name = self.layout.name
        torch.manual_seed(run.seed)
        self.learner = Learner(self.model_cfg, self.parallel, self.layout, optimizer=self.optimizer,
                               total_updates=run.steps)
        held_out = self.task.sample(self.sft.eval_problems, np.random.default_rng(run.seed + EVAL_SEED_OFFSET))
        self.eval_batch = encode_problems(held_out, self.task, self.encoder, self.layout.tp)
        if resume_from is not None:
            meta = load_checkpoint(self.learner, resume_from, trust=run.trust_checkpoint)
            log.info("resumed from %s at step %d", resume_from, int(meta["trainer_step"]))
            return int(meta["trainer_step"])
        if run.init_checkpoint:
            load_start(self.learner, run.init_checkpoint, run.trust_checkpoint)
        return 0

    def step(self, step: int) -> dict[str, float]:
        rng = np.random.default_rng([self.run.seed, step])
        batch = encode_problems(self.task.sample(self.sft.batch_size, rng), self.task, self.encoder, self.layout.tp,
                                rng)
        update = self.learner.train_step(batch, nll_loss(batch))
        out = {"learner/loss": update["nll"]}
        from moe_rl.learner.microbatch import OPTIMIZER_METRICS

        out.update({f"learner/{k}": update[k] for k in OPTIMIZER_METRICS if k in update})
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        self._evaluated = (step, expected_reward(self.learner, self.eval_batch))
        return {"eval/expected_reward": self._evaluated[1]}

    def done(self, step: int, metrics: dict[str, float]) -> bool:
        """sft.target_reward reached at an evaluation (the same number on every rank)."""
        target = self.sft.target_reward
        return bool(target) and metrics.get("eval/expected_reward", -1.0) >= target

    def save(self, path: Path, meta: dict[str, Any], background: bool = False) -> PendingSave:
        from moe_rl.learner.checkpoint import start_checkpoint

        return start_checkpoint(self.learner, path, recipe=self.recipe, extra_meta=meta, background=background)

    def finish(self, last_step: int, final: Path) -> None:
        """Collective: the model alone (no optimizer state) to sft.output."""
        from moe_rl.learner import save_checkpoint

        if self._evaluated is not None and self._evaluated[0] == last_step:
            reward = self._evaluated[1]  # (the last step was evaluated: the same weights)
        else:
            reward = expected_reward(self.learner, self.eval_batch)
        save_checkpoint(self.learner, self.output, include_optimizer=False, recipe=self.recipe,
                        extra_meta={"sft": {"step": last_step, "expected_reward": reward}})
        if self.rank == 0:
            log.info("sft done: %d steps, expected reward %.3f, base model in %s", last_step, reward,
                     self.output)
            if self.run.export_hf and started_from_hf(self.run):
                from moe_rl.convert import megatron_to_hf

                log.info("exported the final model to %s",
                         megatron_to_hf(self.output, self.run.run_dir / "hf", force=True))

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        evals = [(int(h["step"]), h["eval/expected_reward"]) for h in history if "eval/expected_reward" in h]
        return {"algorithm": "sft", "expected_reward": evals[-1][1] if evals else None,
                "eval_expected_reward": [{"step": s, "expected_reward": r} for s, r in evals],
                "checkpoint": str(self.output)}

    def log_line(self, step: int, m: dict[str, float]) -> str | None:
        if "eval/expected_reward" not in m:
            return None
        return f"sft step {step}: nll {m['learner/loss']:.3f}, expected reward {m['eval/expected_reward']:.3f}"

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"nll": f"{metrics['learner/loss']:.3g}"} if "learner/loss" in metrics else {}

    def close(self) -> None:
        self._stack.close()
