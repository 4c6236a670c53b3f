"""Every check of a preference run's inputs (DPO, or the reward model of
`moe_rl.reward_model`), once, before anything is built (`--check` runs them and prints one
line): the layout, the starting weights (for DPO also the reference), the learner's device,
the preference files row by row, the tokenizer, and the longest pair against the model's
positions. Each failure is one `ConfigError` line naming the key, file or row and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from moe_rl.config import Config, ConfigError, validate_layout


class Program(NamedTuple):
    """A preference program: its module, what run.init_checkpoint is to it, and the first
    words of its `--check` line."""

    module: str
    init_role: str
    headline: Callable[[Config], str]


PROGRAMS = {
    "dpo": Program("moe_rl.dpo", "the starting policy, which is also the frozen reference",
                   lambda cfg: f"dpo ({cfg.dpo.loss}, beta {cfg.dpo.beta})"),
    "rm": Program("moe_rl.reward_model", "the starting transformer (its value head starts small and random)",
                  lambda cfg: f"reward model (compare {cfg.rm.compare})"),
}
"""Recipe section -> the program that reads it."""


def load_inputs(cfg: Config, section: str = "dpo") -> tuple[list[Any], list[Any], Any]:
    """(training pairs, held-out pairs, PromptEncoder), or a one-line ConfigError."""
    from moe_rl.preflight import load_prompt_encoder
    from moe_rl.programs.preference.data import load_pairs
    from moe_rl.tasks.dataset import DatasetKeys

    t = cfg.task
    if not t.data_path:
        raise ConfigError(f"{PROGRAMS[section].module} needs task.data_path: a .jsonl or .parquet file of {{prompt | messages, "
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


def check_pairs_run(cfg: Config, world: int, section: str = "dpo") -> tuple[list[Any], list[Any], Any]:
    """Raise a one-line ConfigError for the first input that cannot work in a run of
    `section`'s program (`PROGRAMS`); returns what `load_inputs` read (the run uses it
    rather than reading the files twice)."""
    from moe_rl.preflight import check_init_model, check_learner_device

    validate_layout(cfg, world)
    init = cfg.run.init_checkpoint
    if not init:
        prog = PROGRAMS[section]
        raise ConfigError(f"{prog.module} needs run.init_checkpoint: {prog.init_role} (the tiny recipe uses moe_rl/assets/tiny_base)")
    if not Path(init).exists():
        raise ConfigError(f"run.init_checkpoint={init} does not exist (paths are relative to the working directory)")
    check_init_model(cfg)
    check_learner_device(cfg)
    train, held_out, encoder = load_inputs(cfg, section)
    every = cfg.run.eval_every
    if every and not held_out:
        raise ConfigError(f"run.eval_every={every} needs task.eval_data_path (held-out pairs); "
                          "set it, or run.eval_every=0")
    check_lengths(train + held_out, encoder, cfg.model.max_position_embeddings)
    return train, held_out, encoder


def check_pairs_recipe(cfg: Config, world: int, section: str) -> str:
    """`--check` of a pairs program (`section`: dpo or rm): every check above for `world`
    ranks, then what would run, in one line."""
    from moe_rl.recipe_check import layout_line

    train, held_out, _ = check_pairs_run(cfg, world, section)
    return (f"{PROGRAMS[section].headline(cfg)}, {layout_line(cfg, world)}, {len(train)} pairs ({len(held_out)} "
            f"held out), {cfg.run.steps} steps -> {cfg.run_dir}")
