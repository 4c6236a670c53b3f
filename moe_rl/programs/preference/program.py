"""What the programs that learn from preference pairs (DPO, the reward model) share: the
step's pairs -> one update, the held-out statistics, their summary; the run loop
(`moe_rl.loop`) owns the run directory, evaluation cadence, checkpoints, resume and signals.

A subclass builds its models (`_build`), makes one update on a step's pairs (`_train_on`),
gives the held-out statistics (`_held_out`), and says what a finished run leaves
(`finish`, `_summary_fields`). The pairs of a step are a pure function of run.seed and the
step (`moe_rl.programs.preference.data.pairs_of_step`), so checkpoints resume bit-exactly with the
model, optimizer, schedule and RNG they hold.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.config import (
    Config,
    ConfigError,
    DPOConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardModelConfig,
    RunConfig,
    to_dict,
    validate_layout,
)
from moe_rl.loop import Program

if TYPE_CHECKING:
    from moe_rl.learner.checkpoint import PendingSave
    from moe_rl.learner.parallel import Layout


class PreferenceProgram(Program):
    """One run on preference pairs: `pairs_cfg` is the program's own section (`dpo` or `rm`,
    with batch_size and eval_max_pairs); `self.model` is what trains. Built by `build`,
    from the recipe's sections and the pairs its checks read."""

    name = "preference"
    evaluates_at_start = True
    section = "dpo"
    """The recipe section with its batch size and held-out pairs (`dpo` or `rm`)."""
    module = "moe_rl.dpo"
    """The program's entry point, for the messages."""
    init_role = "the starting weights"
    """What run.init_checkpoint is to the program, for the messages."""

    @classmethod
    def check(cls, cfg: Config, world: int) -> str:
        """The layout, the starting weights, the model, the device, the pairs and their
        lengths (`check_pairs_run`); the `--check` line."""
        from moe_rl.preflight import layout_line

        train, held_out, _ = check_pairs_run(cfg, world, cls)
        return (f"{cls.headline(preference_section(cfg, cls.section))}, {layout_line(cfg, world)}, {len(train)} pairs "
                f"({len(held_out)} held out), {cfg.run.steps} steps -> {cfg.run_dir}")

    @classmethod
    def build(cls, cfg: Config) -> Program:
        """This rank's program, from the recipe's sections, after every check (the pairs
        the checks read are the run's: the files are read once)."""
        from moe_rl.learner import init_distributed

        train, held_out, encoder = check_pairs_run(cfg, int(os.environ.get("WORLD_SIZE", "1")), cls)
        rank, world = init_distributed(cfg.parallel.distributed_backend)
        return cls(preference_section(cfg, cls.section), model=cfg.model, parallel=cfg.parallel, optimizer=cfg.optimizer,
                   run=cfg.run, shuffle=cfg.task.shuffle, pairs=(train, held_out, encoder), recipe=to_dict(cfg),
                   rank=rank, world=world)

    @classmethod
    def headline(cls, pairs_cfg: Any) -> str:
        """The first words of the `--check` line, from the program's own section."""
        raise NotImplementedError

    def __init__(self, pairs_cfg: Any, *, model: ModelConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
                 run: RunConfig, shuffle: bool, pairs: tuple[list[Any], list[Any], Any], recipe: Mapping[str, Any],
                 rank: int, world: int) -> None:
        """`pairs`: (training pairs, held-out pairs, the prompt encoder), as the checks read
        them; `shuffle`: task.shuffle; `recipe`: the resolved recipe's plain data, saved with
        every checkpoint."""
        self.pairs_cfg, self.model_cfg, self.parallel, self.optimizer, self.run = pairs_cfg, model, parallel, optimizer, run
        self.shuffle, self.recipe, self.rank, self.world = shuffle, recipe, rank, world
        self.train_pairs, self.eval_pairs, self.encoder = pairs
        if self.pairs_cfg.eval_max_pairs:
            self.eval_pairs = self.eval_pairs[: self.pairs_cfg.eval_max_pairs]
        self.log = logging.getLogger(type(self).__module__)
        self.model: Any = None
        self.eval_tokens: Any = None
        self._stack = contextlib.ExitStack()

    def _build(self, layout: Layout, resume_from: Path | None) -> None:
        """Build `self.model` (and whatever else the algorithm needs), from `resume_from` or
        from run.init_checkpoint, and set `self.eval_tokens`."""
        raise NotImplementedError

    def _train_on(self, tokens: Any) -> tuple[dict[str, float], dict[str, float]]:
        """One optimizer update on a step's pairs (2P rows, `encode_pairs`' layout): (the pair
        statistics before it, `loss` included; the learner's update metrics)."""
        raise NotImplementedError

    def _held_out(self) -> dict[str, float]:
        """The pair statistics of the held-out pairs; collective."""
        raise NotImplementedError

    def _summary_fields(self) -> dict[str, Any]:
        """The algorithm's own fields of summary.json (its name and settings)."""
        raise NotImplementedError

    def setup(self, resume_from: Path | None) -> int:
        """The seed, the layout, the models (resumed or from their start)."""
        from moe_rl.learner import load_checkpoint, parallel_layout

        self.layout = self._stack.enter_context(parallel_layout(self.parallel, seed=self.run.seed))
        self.layout_name = self.layout.name
        torch.manual_seed(self.run.seed)
        self._build(self.layout, resume_from)
        if resume_from is None:
            return 0
        meta = load_checkpoint(self.model, resume_from, trust=self.run.trust_checkpoint)
        start = int(meta.get("trainer_step", meta["step"]))
        self.log.info("resumed from %s at step %d", resume_from, start)
        return start

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step on the step's pairs: the loss as `learner/loss`, the
        statistics under their own names (TRL's)."""
        from moe_rl.programs.preference.data import encode_pairs, pairs_of_step

        pairs = pairs_of_step(self.train_pairs, step - 1, self.pairs_cfg.batch_size, self.run.seed, self.shuffle)
        stats, update = self._train_on(encode_pairs(pairs, self.encoder, self.layout.tp))
        metrics = {("learner/loss" if k == "loss" else k): v for k, v in stats.items()}
        from moe_rl.learner.microbatch import OPTIMIZER_METRICS

        metrics.update({f"learner/{k}": update[k] for k in OPTIMIZER_METRICS if k in update})
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out metrics (`eval/...`); collective."""
        if self.eval_tokens is None:
            return {}
        return {f"eval/{k}": v for k, v in self._held_out().items()}

    def save(self, path: Path, meta: dict[str, Any], background: bool = False) -> PendingSave:
        """Collective: the model, optimizer, schedule and RNG."""
        from moe_rl.learner.checkpoint import start_checkpoint

        return start_checkpoint(self.model, path, recipe=self.recipe, extra_meta=meta, background=background)

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The algorithm's fields and the held-out accuracy at every evaluation and the last."""
        evals = eval_accuracies(history)
        return {**self._summary_fields(), "eval_accuracy": [{"step": s, "accuracy": a} for s, a in evals],
                "final_eval_accuracy": evals[-1][1] if evals else None}

    def log_line(self, step: int, m: dict[str, float]) -> str:
        held = (f", held-out accuracy {m['eval/rewards/accuracies']:.3f}" if "eval/rewards/accuracies" in m else "")
        return (f"{self.name} step {step}: loss {m['learner/loss']:.4f}, accuracy {m['rewards/accuracies']:.2f}, "
                f"margin {m['rewards/margins']:.3f}{held}")

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        keys = [("loss", "learner/loss"), ("acc", "rewards/accuracies"), ("margin", "rewards/margins")]
        return {short: f"{metrics[k]:.3g}" for short, k in keys if k in metrics}

    def close(self) -> None:
        self._stack.close()


def eval_accuracies(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, held-out preference accuracy) of every evaluation in a run's logged rows."""
    return [(int(h["step"]), h["eval/rewards/accuracies"]) for h in history if "eval/rewards/accuracies" in h]


# ------------------------------------------------------------------ the checks, before anything is built
# Every check of a preference run's inputs, once, before anything is built (`--check` runs
# them and prints one line): the layout, the starting weights (for DPO also the reference),
# the learner's device, the preference files row by row, the tokenizer, and the longest pair
# against the model's positions. Each failure is one `ConfigError` line naming the key, file
# or row and the fix.


def preference_section(cfg: Config, section: str) -> DPOConfig | RewardModelConfig:
    """The recipe section a preference program reads its batch size and held-out pairs from."""
    sections: dict[str, DPOConfig | RewardModelConfig] = {"dpo": cfg.dpo, "rm": cfg.rm}
    return sections[section]


def load_pairs_inputs(cfg: Config, module: str) -> tuple[list[Any], list[Any], Any]:
    """(training pairs, held-out pairs, PromptEncoder) for the program `module`, or a
    one-line ConfigError."""
    from moe_rl.preflight import load_prompt_encoder
    from moe_rl.programs.preference.data import load_pairs
    from moe_rl.tasks.dataset import DatasetKeys

    t = cfg.task
    if not t.data_path:
        raise ConfigError(f"{module} needs task.data_path: a .jsonl or .parquet file of {{prompt | messages, "
                          "chosen, rejected} rows (tools/make_preference_data.py writes one for the tiny task)")
    keys = DatasetKeys.from_config(t)
    try:
        train = load_pairs(t.data_path, keys)
        held_out = load_pairs(t.eval_data_path, keys) if t.eval_data_path else []
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from e
    _, encoder = load_prompt_encoder(cfg)
    return train, held_out, encoder


def check_lengths(pairs: list[Any], encoder: Any, positions: int) -> None:
    """The longest prompt + response + EOS of any pair fits model.max_position_embeddings."""
    tok = encoder.tokenizer
    try:
        longest = max((len(encoder.encode(p.problem)) + len(tok.encode(text, eos=True)), p.problem.meta["where"])
                      for p in pairs for text in (p.chosen, p.rejected))
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from e
    if longest[0] > positions:
        raise ConfigError(f"{longest[1]}: the prompt and a response take {longest[0]} tokens but "
                          f"model.max_position_embeddings={positions}; shorten the row or raise "
                          "model.max_position_embeddings")


def check_pairs_run(cfg: Config, world: int, program: type[PreferenceProgram]) -> tuple[list[Any], list[Any], Any]:
    """Raise a one-line ConfigError for the first input that cannot work in a run of
    `program`; returns what `load_pairs_inputs` read (the run uses it rather than reading
    the files twice)."""
    from moe_rl.preflight import check_init_model, check_learner_device

    validate_layout(cfg, world)
    init = cfg.run.init_checkpoint
    if not init:
        raise ConfigError(f"{program.module} needs run.init_checkpoint: {program.init_role} (the tiny recipe uses "
                          "moe_rl/assets/tiny_base)")
    if not Path(init).exists():
        raise ConfigError(f"run.init_checkpoint={init} does not exist (paths are relative to the working directory)")
    check_init_model(cfg)
    check_learner_device(cfg)
    train, held_out, encoder = load_pairs_inputs(cfg, program.module)
    every = cfg.run.eval_every
    if every and not held_out:
        raise ConfigError(f"run.eval_every={every} needs task.eval_data_path (held-out pairs); "
                          "set it, or run.eval_every=0")
    check_lengths(train + held_out, encoder, cfg.model.max_position_embeddings)
    return train, held_out, encoder
