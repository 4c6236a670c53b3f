"""Every check of a run's inputs, in one place, run once before anything is built (no model,
no process group, no engine), so that a recipe that cannot run fails in a second with one
line naming the key:

    check_run(cfg, world)                     # the RL program: everything below, for `world` ranks
    check_start(cfg, init_required=False, completions=True)   # what every learner program checks

Each program states its own checks (`moe_rl.loop.Program.check`) from these pieces: RL runs
`check_run`; SFT the layout and `check_start` with its completions' lengths; DPO and the
reward model their pairs (`moe_rl.programs.preference.program`). `--check` prints the
program's line, which `layout_line` begins:

    python -m moe_rl.train --check --nproc 256 --config examples/gpu/deepseek_v3.yaml
    # recipe OK: rspo, 256 ranks (TP8 PP1 EP256 DP32), model 61 layers x 256 experts (top-8) from /models/x, ...

The launch scripts run it once before torchrun, so a bad recipe is this one line rather
than one error per rank under torchrun's own traceback.

What it covers, in order:
- the layout against the world size (`config.validate_layout`), and (RL) that every
  mini-batch of the actor's and the critic's gets a row (`config.validate_minibatches`);
- the starting weights: `run.init_checkpoint` exists and holds the recipe's model;

- the task builds (`task.name`, `task.data_path`, digit ranges) and the tokenizer loads
  (`task.tokenizer`) and fits `model.vocab_size`;
- the longest prompt (every row of a file-backed task; 512 draws of a synthetic one, whose
  longest prompts are the common ones) plus `sampler.max_new_tokens` (RL) or plus the
  reference completion and EOS (SFT) fits `model.max_position_embeddings`. Beyond it the
  learner's rotary positions and the sampler's context disagree, or the sampler refuses the
  prompt mid-run;
- a user reward function imports and runs on the first problem;
- the advantage estimator: under PPO (`rl.advantage=gae`) a token-level objective and the
  critic's starting weights;
- what this device can do: the learner's precision and optimizer (bf16 training and the
  distributed optimizer need CUDA), the sampler's (sleep mode needs a GPU, R3 needs an
  engine that returns routed experts) and the engine's own limits
  (`moe_rl.sampler.check_engine_limits`).
The recipe's static checks (`config.validate`) ran when it was loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_rl.config import Config, ConfigError, validate_layout, validate_minibatches

SYNTHETIC_DRAWS = 512


def check_run(cfg: Config, world: int) -> None:
    """The RL program's checks: raise a one-line ConfigError for the first input of the run
    that cannot work (see the module docstring). `world`: ranks in the torchrun world
    (WORLD_SIZE)."""
    dp = validate_layout(cfg, world)
    validate_minibatches(cfg, dp)
    if cfg.run.eval_every and not cfg.task.eval_data_path:
        raise ConfigError(f"run.eval_every={cfg.run.eval_every} needs task.eval_data_path (the held-out "
                          "prompts); set it, or run.eval_every=0")
    check_init_weights(cfg, required=True)
    if cfg.rl.kl_coef > 0 and not cfg.run.init_checkpoint:
        raise ConfigError("rl.kl_coef > 0 needs run.init_checkpoint (the reference policy)")
    check_task_inputs(cfg)
    check_init_model(cfg)
    check_learner_device(cfg)
    check_reward(cfg)
    check_sampler(cfg)
    check_advantage(cfg)


def check_start(cfg: Config, *, init_required: bool, completions: bool) -> None:
    """What a learner program checks (RL's `check_run` in its own order): its starting weights (`init_required`: a fresh run
    needs run.init_checkpoint), the task's inputs and their lengths (`completions`: with the
    reference completions, as supervised training feeds them), the model the weights hold,
    and what the device can train."""
    check_init_weights(cfg, required=init_required)
    check_task_inputs(cfg, completions=completions)
    check_init_model(cfg)
    check_learner_device(cfg)


def check_init_weights(cfg: Config, *, required: bool = True) -> None:
    """The starting weights are named (when `required`; a resume continues from the run's
    own) and exist."""
    init = cfg.run.init_checkpoint
    if not init and not cfg.run.resume and required:
        raise ConfigError("run.init_checkpoint is required: a moe_rl checkpoint or a Hugging Face directory "
                          "(the tiny recipes use moe_rl/assets/tiny_base)")
    if init and not Path(init).exists():
        raise ConfigError(f"run.init_checkpoint={init} does not exist (paths are relative to the working directory)")


def check_advantage(cfg: Config) -> None:
    """The advantage estimator exists; a critic's token advantages (PPO's `rl.advantage=gae`)
    go to a token-level objective, and the critic's starting weights exist."""
    from moe_rl.advantages import ADVANTAGES
    from moe_rl.objectives import OBJECTIVES

    rl = cfg.rl
    if rl.advantage not in ADVANTAGES:
        raise ConfigError(f"rl.advantage={rl.advantage!r} is unknown; valid: {', '.join(ADVANTAGES)}")
    if not rl.uses_critic:
        return
    if OBJECTIVES[rl.objective].level == "sequence":
        token_level = [n for n in OBJECTIVES if OBJECTIVES[n].level == "token"]
        raise ConfigError(f"rl.objective={rl.objective} is sequence-level (one advantage per sequence) and cannot "
                          f"take {rl.advantage}'s per-token advantages; use a token-level one: {', '.join(token_level)}")
    init = cfg.critic.init_checkpoint
    if init and not Path(init).exists():
        raise ConfigError(f"critic.init_checkpoint={init} does not exist (empty: the actor's run.init_checkpoint)")


def check_learner_device(cfg: Config) -> None:
    """What megatron-core's optimizer and the learner accept on this device."""
    cuda = torch.cuda.is_available()
    if cfg.model.dtype_on(cuda) == "bf16" and not cuda:
        raise ConfigError("model.params_dtype=bf16 training needs CUDA: megatron-core's mixed-precision "
                          "optimizer only takes CUDA tensors. Train in fp32 on CPU (a bf16 learner can still "
                          "score, e.g. in tools/measure_mismatch.py)")
    if cfg.optimizer.distributed and not cuda:
        raise ConfigError("optimizer.distributed=true needs CUDA: megatron-core's distributed optimizer only "
                          "takes CUDA tensors; leave it false on CPU")
    check_gpu_only_settings(cfg, cuda)


def check_gpu_only_settings(cfg: Config, cuda: bool) -> None:
    """The model settings that need the Transformer Engine spec on a GPU (fused permutation,
    gradient-accumulation fusion, CUDA graphs, expert capacity) are off on CPU and with
    `model.layer_spec=local` (the learner checks TE itself when it builds)."""
    from moe_rl.config.model import GPU_ONLY_DEFAULTS

    if cuda and cfg.model.layer_spec != "local":
        return
    where = "there is no GPU here" if not cuda else "model.layer_spec=local"
    for key, value in cfg.model.gpu_only_settings().items():
        off = GPU_ONLY_DEFAULTS[key.removeprefix("model.")]
        shown, off_shown = (str(v).lower() if isinstance(v, bool) else str(v) for v in (value, off))
        raise ConfigError(f"{key}={shown} needs the Transformer Engine layer spec on a GPU, and {where}: "
                          f"set it to {off_shown}")


def check_sampler(cfg: Config) -> None:
    """The sampler backend can do what the recipe asks of it on this device."""
    from moe_rl.sampler import check_engine_limits

    s, cuda = cfg.sampler, torch.cuda.is_available()
    if s.top_p < 1:
        raise ConfigError(f"sampler.top_p={s.top_p} samples from a truncated distribution while the learner scores "
                          "the full softmax, so every ratio (and the correction) would be biased; RL trains at "
                          "sampler.top_p=1 (evaluation and tools/measure_mismatch.py --top-p still take it)")
    if cfg.rl.replay == "R3" and s.backend == "vllm" and not cuda:
        raise ConfigError("rl.replay=R3 needs the sampler's routed experts, which vLLM cannot return on CPU "
                          "(no V2 model runner); use sampler.backend=transformers")
    if s.sleep_between_steps and not cuda:
        raise ConfigError("sampler.sleep_between_steps needs a GPU (vLLM's sleep mode frees GPU memory; "
                          "there is none to free on CPU)")
    check_engine_limits(cfg.sampler, cfg.model)


def _build(cfg: Config) -> tuple[Any, Any, Any]:
    from moe_rl.tasks import make_task

    t = cfg.task
    try:
        task = make_task(t)
    except ConfigError:
        raise  # already names its key (task.length_profile)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"task.name={t.name} (task.data_path={t.data_path!r}): {' '.join(str(e).split())}") from e
    return (task, *load_prompt_encoder(cfg))


def load_prompt_encoder(cfg: Config) -> tuple[Any, Any]:
    """The run's tokenizer (checked against `model.vocab_size`) and its prompt encoder; a
    one-line ConfigError naming `task.tokenizer` when either cannot be had."""
    from moe_rl.tokenization import PromptEncoder, check_fits_model, load_tokenizer

    t = cfg.task
    try:
        tok = load_tokenizer(t.tokenizer, cfg.run.init_checkpoint or None)
        check_fits_model(tok, cfg.model.vocab_size)
        return tok, PromptEncoder.from_config(t, tok)
    except (ValueError, OSError, RuntimeError) as e:
        raise ConfigError(f"task.tokenizer={t.tokenizer!r}: {' '.join(str(e).split())}") from e


def _where(problem: Any) -> str:
    meta = getattr(problem, "meta", {}) or {}
    if "path" in meta and "line" in meta:
        return f" (row {meta['line']} of {meta['path']})"
    return ""


def check_task_inputs(cfg: Config, *, completions: bool = False) -> None:
    """Raise a one-line ConfigError when the task, the tokenizer or the longest sequence
    does not fit the model (see the module docstring)."""
    task, _, prompts = _build(cfg)
    problems = getattr(task, "problems", None) or task.sample(SYNTHETIC_DRAWS, cfg.run.seed)
    positions = cfg.model.max_position_embeddings
    try:
        lengths = _lengths(cfg, task, prompts, problems, completions)
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


def _lengths(cfg: Config, task: Any, prompts: Any, problems: list[Any], completions: bool) -> list[int]:
    """Each problem's prompt ids (with `completions`, its whole supervised example) as the run
    will build them: a multi-turn episode's opening shows its environment's tools, a tool
    task's supervised example is a whole conversation (`moe_rl.tokenization.turns`). Building
    them loads a user's environment and tools, so their import errors surface here."""
    if completions and hasattr(task, "sft_conversation"):
        from moe_rl.tokenization.turns import encode_conversations

        batch = encode_conversations([task.sft_conversation(p, None) for p in problems], task, prompts, 1)
        return batch.total_lens_B.tolist()
    if completions:
        return [sum(map(len, prompts.encode_example(p, task.completion(p)))) for p in problems]
    if cfg.rl.multi_turn:
        from moe_rl.rollout.episodes import Episodes

        episodes = Episodes(task, prompts.tokenizer, prompts.template, rl=cfg.rl, task_cfg=cfg.task,
                            max_new_tokens=cfg.sampler.max_new_tokens)
        return [len(episodes.start(p, 1)[0]) for p in problems]
    return [len(prompts.encode(p)) for p in problems]


def check_init_model(cfg: Config) -> None:
    """`run.init_checkpoint`, when it is a megatron checkpoint, must hold the model the
    recipe describes (the same tensors and shapes): named here, from its config.yaml, before
    anything is built, instead of as a shape mismatch deep inside the load. (A Hugging Face
    directory's config.json is compared when it is loaded.)"""
    import dataclasses
    from pathlib import Path

    from moe_rl.config import ModelConfig, load_saved_config
    from moe_rl.convert.megatron_keys import megatron_specs

    init = Path(cfg.run.init_checkpoint) if cfg.run.init_checkpoint else None
    if init is not None and (init / "config.json").is_file():
        check_hf_weights(init, cfg.model)
        return
    if init is None or not (init / "config.yaml").is_file() or not (init / "moe_rl.json").is_file():
        return
    try:
        saved = load_saved_config(init / "config.yaml").model
    except ConfigError as e:
        raise ConfigError(f"run.init_checkpoint={init}: its config.yaml: {e}") from e
    if megatron_specs(saved) == megatron_specs(cfg.model):
        return
    diff = [f"model.{f.name}={getattr(cfg.model, f.name)!r} (the checkpoint has {getattr(saved, f.name)!r})"
            for f in dataclasses.fields(ModelConfig) if _differs(f.name, saved, cfg.model)]
    raise ConfigError(f"run.init_checkpoint={init} holds another model than the recipe's: {', '.join(diff[:4])}; "
                      "make the recipe's model section match the checkpoint's config.yaml")


def _differs(name: str, saved: Any, model: Any) -> bool:
    """A model field that really differs: `params_dtype: auto` equals the dtype it resolves to
    on this device (the message must not list it beside the real difference)."""
    if name == "params_dtype":
        cuda = torch.cuda.is_available()
        return saved.dtype_on(cuda) != model.dtype_on(cuda)
    return getattr(saved, name) != getattr(model, name)


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


def layout_line(cfg: Config, world: int) -> str:
    """'N ranks (TPx PPx EPx DPx), model L layers x E experts (top-k) from START'."""
    p, m = cfg.parallel, cfg.model
    dp = validate_layout(cfg, world)
    layout = (f"{world} rank{'s' if world > 1 else ''} (TP{p.tensor_model_parallel_size} "
              f"PP{p.pipeline_model_parallel_size} EP{p.expert_model_parallel_size} DP{dp})")
    start = cfg.run.init_checkpoint or "random init"
    return f"{layout}, model {m.num_layers} layers x {m.num_experts} experts (top-{m.moe_router_topk}) from {start}"


def check_rl_recipe(cfg: Config, world: int) -> str:
    """The RL program's `--check`: every pre-flight check for `world` ranks (raises
    ConfigError), then what would run."""
    check_run(cfg, world)
    return f"{cfg.rl.objective}, {layout_line(cfg, world)}, {cfg.run.steps} steps -> {cfg.run_dir}"
