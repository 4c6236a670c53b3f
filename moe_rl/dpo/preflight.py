"""Every check of a DPO run's inputs, once, before anything is built (`--check` runs them
and prints one line): the layout, the starting weights (which are also the reference), the
learner's device, the preference files row by row, the tokenizer, and the longest pair
against the model's positions. Each failure is one `ConfigError` line naming the key, file
or row and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.config import Config, ConfigError, validate_layout


def load_inputs(cfg: Config) -> tuple[list[Any], list[Any], Any]:
    """(training pairs, held-out pairs, PromptEncoder), or a one-line ConfigError."""
    from moe_rl.dpo.data import load_pairs
    from moe_rl.preflight import load_prompt_encoder
    from moe_rl.tasks.dataset import DatasetKeys

    t = cfg.task
    if not t.data_path:
        raise ConfigError("moe_rl.dpo needs task.data_path: a .jsonl or .parquet file of {prompt | messages, "
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


def check_dpo_run(cfg: Config, world: int) -> tuple[list[Any], list[Any], Any]:
    """Raise a one-line ConfigError for the first input that cannot work; returns what
    `load_inputs` read (the run uses it rather than reading the files twice)."""
    from moe_rl.preflight import check_init_model, check_learner_device

    validate_layout(cfg, world)
    init = cfg.run.init_checkpoint
    if not init:
        raise ConfigError("moe_rl.dpo needs run.init_checkpoint: the starting policy, which is also the frozen "
                          "reference (the tiny recipe uses moe_rl/assets/tiny_base)")
    if not Path(init).exists():
        raise ConfigError(f"run.init_checkpoint={init} does not exist (paths are relative to the working directory)")
    check_init_model(cfg)
    check_learner_device(cfg)
    train, held_out, encoder = load_inputs(cfg)
    if cfg.dpo.eval_every and not held_out:
        raise ConfigError(f"dpo.eval_every={cfg.dpo.eval_every} needs task.eval_data_path (held-out pairs); "
                          "set it, or dpo.eval_every=0")
    check_lengths(train + held_out, encoder, cfg.model.max_position_embeddings)
    return train, held_out, encoder


def summary(cfg: Config, world: int, train: list[Any], held_out: list[Any]) -> str:
    """What would run, in one line."""
    p, m, d = cfg.parallel, cfg.model, cfg.dpo
    dp = validate_layout(cfg, world)
    layout = (f"{world} rank{'s' if world > 1 else ''} (TP{p.tensor_model_parallel_size} "
              f"PP{p.pipeline_model_parallel_size} EP{p.expert_model_parallel_size} DP{dp})")
    return (f"dpo ({d.loss}, beta {d.beta}), {layout}, model {m.num_layers} layers x {m.num_experts} experts "
            f"(top-{m.moe_router_topk}) from {cfg.run.init_checkpoint}, {len(train)} pairs ({len(held_out)} held "
            f"out), {cfg.run.steps} steps -> {cfg.run_dir}")


def check_recipe(cfg: Config, world: int) -> str:
    """`--check`: every check above for `world` ranks, then the summary line."""
    train, held_out, _ = check_dpo_run(cfg, world)
    return summary(cfg, world, train, held_out)
