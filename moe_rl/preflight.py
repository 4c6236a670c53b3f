"""Checks of a run's inputs that need the task and the tokenizer but no model and no process
group, so that a recipe that cannot run fails in a second with one line naming the key:

    check_task_inputs(cfg)                    # RL: longest prompt + sampler.max_new_tokens
    check_task_inputs(cfg, completions=True)  # SFT: longest prompt + reference completion
    check_init_model(cfg)                     # run.init_checkpoint holds the recipe's model

- the task builds (`task.name`, `task.data_path`, digit ranges) and the tokenizer loads
  (`task.tokenizer`) and fits `model.vocab_size`;
- the longest prompt (every row of a file-backed task; 512 draws of a synthetic one, whose
  longest prompts are the common ones) plus `sampler.max_new_tokens` (RL) or plus the
  reference completion and EOS (SFT) fits `model.max_position_embeddings`. Beyond it the
  learner's rotary positions and the sampler's context disagree, or the sampler refuses the
  prompt mid-run.
"""

from __future__ import annotations

from typing import Any

from moe_rl.config import Config, ConfigError

SYNTHETIC_DRAWS = 512


def _build(cfg: Config) -> tuple[Any, Any, Any]:
    from moe_rl.tasks import make_task
    from moe_rl.tokenization import PromptEncoder, check_fits_model, load_tokenizer

    t = cfg.task
    try:
        task = make_task(t)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"task.name={t.name} (task.data_path={t.data_path!r}): {' '.join(str(e).split())}") from e
    try:
        tok = load_tokenizer(t.tokenizer, cfg.run.init_checkpoint or None)
        check_fits_model(tok, cfg.model.vocab_size)
        prompts = PromptEncoder.from_config(t, tok)
    except (ValueError, OSError, RuntimeError) as e:
        raise ConfigError(f"task.tokenizer={t.tokenizer!r}: {' '.join(str(e).split())}") from e
    return task, tok, prompts


def _where(problem: Any) -> str:
    meta = getattr(problem, "meta", {}) or {}
    if "path" in meta and "line" in meta:
        return f" (row {meta['line']} of {meta['path']})"
    return ""


def check_task_inputs(cfg: Config, *, completions: bool = False) -> None:
    """Raise a one-line ConfigError when the task, the tokenizer or the longest sequence
    does not fit the model (see the module docstring)."""
    task, tok, prompts = _build(cfg)
    problems = getattr(task, "problems", None) or task.sample(SYNTHETIC_DRAWS, cfg.run.seed)
    positions = cfg.model.max_position_embeddings
    if completions:
        lengths = [sum(map(len, tok.encode_example(p.prompt, task.completion(p)))) for p in problems]
    else:
        try:
            lengths = [len(prompts.encode(p)) for p in problems]
        except ValueError as e:
            raise ConfigError(" ".join(str(e).split())) from e
    i = max(range(len(lengths)), key=lengths.__getitem__)
    if completions and lengths[i] > positions:
        raise ConfigError(f"the longest SFT example{_where(problems[i])} has {lengths[i]} tokens but "
                          f"model.max_position_embeddings={positions}: shorten the task's problems "
                          "(task.max_digits) or raise model.max_position_embeddings")
    new = cfg.sampler.max_new_tokens
    if not completions and lengths[i] + new > positions:
        room = positions - lengths[i]
        fix = f"lower sampler.max_new_tokens to {room}" if room > 0 else "shorten the prompts"
        raise ConfigError(f"the longest prompt{_where(problems[i])} has {lengths[i]} tokens; with "
                          f"sampler.max_new_tokens={new} a sequence needs {lengths[i] + new} positions but "
                          f"model.max_position_embeddings={positions}: {fix} (or raise "
                          "model.max_position_embeddings)")


def check_init_model(cfg: Config) -> None:
    """`run.init_checkpoint`, when it is a megatron checkpoint, must hold the model the
    recipe describes (the same tensors and shapes): named here, from its config.yaml, before
    anything is built, instead of as a shape mismatch deep inside the load. (A Hugging Face
    directory's config.json is compared when it is loaded.)"""
    import dataclasses
    from pathlib import Path

    from moe_rl.config import ModelConfig, load_config
    from moe_rl.convert.megatron_keys import megatron_specs

    init = Path(cfg.run.init_checkpoint) if cfg.run.init_checkpoint else None
    if init is not None and (init / "config.json").is_file():
        check_hf_weights(init, cfg.model)
        return
    if init is None or not (init / "config.yaml").is_file() or not (init / "moe_rl.json").is_file():
        return
    try:
        saved = load_config(init / "config.yaml").model
    except ConfigError as e:
        raise ConfigError(f"run.init_checkpoint={init}: its config.yaml: {e}") from e
    if megatron_specs(saved) == megatron_specs(cfg.model):
        return
    diff = [f"model.{f.name}={getattr(cfg.model, f.name)!r} (the checkpoint has {getattr(saved, f.name)!r})"
            for f in dataclasses.fields(ModelConfig) if getattr(saved, f.name) != getattr(cfg.model, f.name)]
    raise ConfigError(f"run.init_checkpoint={init} holds another model than the recipe's: {', '.join(diff[:4])}; "
                      "make the recipe's model section match the checkpoint's config.yaml")


def check_hf_weights(directory: Any, model: Any) -> None:
    """A Hugging Face directory's safetensors hold exactly the tensors and shapes its
    config.json implies (headers only, no data read)."""
    from moe_rl.convert import ConvertError, HFCheckpoint, check_tensors

    try:
        with HFCheckpoint(directory) as hf:
            check_tensors(hf, model)
    except (ConvertError, NotImplementedError) as e:
        raise ConfigError(f"run.init_checkpoint={directory}: {' '.join(str(e).split())}") from e


def check_reward(cfg: Config) -> None:
    """A user reward function (`task.reward=module:function`) is imported and tried on the
    first problem with an empty response before anything starts: a typo, an import error or
    a function that raises fails in a second, with nothing written."""
    if cfg.task.reward == "math" or cfg.task.name != "dataset":
        return
    task, _, _ = _build(cfg)
    problems = getattr(task, "problems", None) or task.sample(1, cfg.run.seed)
    try:
        task.reward(problems[0], "")
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from e
