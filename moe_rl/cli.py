"""Command-line plumbing shared by the entry points (`moe_rl.train`, `moe_rl.sft`,
`moe_rl.plan`, tools).

    python -m moe_rl.train --config examples/tiny_rspo.yaml rl.objective=gspo run.steps=20
    python -m moe_rl.train --help-config        # every key, its type, default and docstring

Errors: `run_guarded(prog, fn, debug=args.debug)` runs a program's body and turns what
escapes it into ONE line on stderr, `<prog>: error: <what, naming the field, file or row,
and the fix>`, with exit status 2 for the user's input (config, files, checkpoints, a full
disk), 3 for a fault met while training (`moe_rl.runtime.failures.RunFaultError`: updates that
stay non-finite, an engine that failed) and 1 for anything else (a bug). A bug's full
traceback is kept without a rerun: the rank that failed writes it to
`<run>/error-rank<k>.log` (before the run directory exists, or for a tool without one, to a
temporary file), and the line names the file. `--debug` (or MOE_RL_DEBUG=1) lets the
traceback through instead.

    def main(argv=None) -> int:
        args = parser().parse_args(argv)        # add_debug_flag(parser) adds --debug
        return run_guarded(PROG, lambda: run(args), debug=args.debug)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from moe_rl.checkpoints.errors import CheckpointError
from moe_rl.config import Config, ConfigError, describe
from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.runtime.failures import (
    USER_ERROR,
    RunFaultError,
    causes,
    describe_error,
    disk_full,
    exit_status,
    lost_peer,
)
from moe_rl.runtime.manual_gc import skip_final_collections

if TYPE_CHECKING:
    from moe_rl.loop import Program

T = TypeVar("T")


def add_debug_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--debug", action="store_true",
                    help="show the full traceback of an error instead of one line (also MOE_RL_DEBUG=1)")


def parse(argv: list[str] | None, prog: str, doc: str,
          program: Callable[[], type[Program]]) -> tuple[argparse.Namespace, Config]:
    """`--config FILE` plus `section.key=value` overrides -> a validated Config (loaded, its
    model taken from run.init_checkpoint's config.json, then checked). A bad recipe exits
    with status 2 and one line, printed by rank 0 only under torchrun. `--check` checks the
    whole run for `--nproc` processes (the program's `Program.check`, `program()` being its
    class, imported only then), prints `recipe OK: ...` and exits 0: the launch scripts run
    it once before torchrun."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe (sections: model, parallel, optimizer, rl, ...)")
    ap.add_argument("--help-config", action="store_true", help="list every config key and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check the recipe and the run's inputs for --nproc processes, print one line, exit")
    ap.add_argument("--nproc", type=int, default=None,
                    help="with --check: the world size to check for (default: $WORLD_SIZE or 1)")
    add_debug_flag(ap)
    add_verbose_flag(ap)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = ap.parse_intermixed_args(argv)  # overrides may sit between the flags
    if args.help_config:
        print(describe())
        sys.exit(0)
    try:
        from moe_rl.runtime.wandb_log import require_wandb

        cfg = load_resolved(args.config, args.overrides, program=prog.removeprefix("python -m "))
        require_wandb(cfg.logging)  # (an optional extra: named before anything is built)
        world = _check_world(args.nproc)
    except ConfigError as e:
        if _debugging(args.debug):
            raise
        config_error_exit(prog, e)
    if args.check:
        sys.exit(run_guarded(prog, lambda: _check(cfg, world, program()), debug=args.debug))
    return args, cfg


def _check(cfg: Config, world: int, program: type[Program]) -> int:
    print(f"recipe OK: {program.check(cfg, world)}")
    return 0


def _check_world(nproc: int | None) -> int:
    world = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 1:
        raise ConfigError(f"--nproc must be >= 1, got {world}")
    return world


def is_rank_zero() -> bool:
    """Rank 0 of a torchrun world, or a plain process (no RANK set)."""
    return os.environ.get("RANK", "0") in ("", "0")


RANK_ZERO_GRACE_S = 3.0
"""On an error every rank sees, the other ranks wait this long before exiting: torchrun
stops the whole world at the first exit, and rank 0 must have printed the line by then."""


def config_error_exit(prog: str, e: ConfigError) -> NoReturn:
    """Print `<prog>: config error: <message>` and exit with status 2. Under torchrun only
    rank 0 prints (every rank reads the same recipe, the others would repeat it)."""
    if is_rank_zero():
        print(f"{prog}: config error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK_ZERO_GRACE_S)
    sys.exit(USER_ERROR)


def add_verbose_flag(ap: argparse.ArgumentParser) -> None:
    """`--verbose`: show the third-party warnings `moe_rl.runtime.noise` hides (MOE_RL_WARNINGS=1)."""
    ap.add_argument("--verbose", action=_ShowWarnings, nargs=0,
                    help="show known-harmless third-party warnings too (also MOE_RL_WARNINGS=1)")


class _ShowWarnings(argparse.Action):
    """Acts as soon as the flag is parsed: warnings of what runs next must not be hidden."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from moe_rl.runtime.noise import show_third_party_warnings

        setattr(namespace, self.dest, True)
        show_third_party_warnings()


def _debugging(flag: bool) -> bool:
    return flag or os.environ.get("MOE_RL_DEBUG") == "1"


def error_line(prog: str, e: BaseException) -> tuple[str, int]:
    """The one line printed for `e`, and the exit status. Our own errors already say what
    happened; a full disk is named as such whatever error reported it."""
    if not isinstance(e, ConfigError | CheckpointError) and disk_full(e):
        where = next((getattr(c, "filename", None) for c in causes(e) if getattr(c, "filename", None)), None)
        return (f"{prog}: error: disk full{f' writing {where}' if where else ''}: free space there or write "
                "elsewhere (run.output_dir / --out / --dst)", USER_ERROR)
    status = exit_status(e)
    if isinstance(e, RunFaultError):
        return f"{prog}: error: {e}", status
    if lost_peer(e):
        return (f"{prog}: error: another rank of this job ended while this one waited for it ({describe_error(e)}); "
                "its own line or torchrun's report above names why; the latest checkpoint stays valid "
                "(run.resume=true continues from it)", status)
    if status == USER_ERROR:
        return f"{prog}: error: {describe_error(e)}", status
    return f"{prog}: internal error: {describe_error(e)}", status


def is_internal(e: BaseException) -> bool:
    """A bug rather than the user's input, a training fault or a lost peer: what `error_line`
    calls an internal error."""
    return error_line("", e)[0].startswith(": internal error")


def keep_traceback(prog: str, e: BaseException, run_dir: Path | None) -> Path | None:
    """The full traceback of `e` in `<run_dir>/error-rank<k>.log` (k: this process's RANK), or in
    a new temporary file when there is no run directory yet; None if neither can be written
    (the one line is printed regardless)."""
    rank = int(os.environ.get("RANK", "0"))
    text = (f"{prog}: internal error on rank {rank} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            + "".join(traceback.format_exception(e)))
    try:
        if run_dir is not None and run_dir.is_dir():
            path = run_dir / f"error-rank{rank}.log"
            atomic_write_text(path, text)
            return path
        fd, name = tempfile.mkstemp(prefix=f"moe_rl-error-rank{rank}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def run_guarded(prog: str, fn: Callable[[], T], *, debug: bool = False,
                run_dir: Callable[[], Path | None] = lambda: None) -> T | int:
    """`fn()`; on an error, print `error_line` and return its exit status instead (with
    `debug`, re-raise). An internal error's traceback is kept (`keep_traceback`, in
    `run_dir()` when it returns an existing directory) and its file named in the line.
    KeyboardInterrupt is one line and status 130."""
    try:
        return fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if _debugging(debug):
            raise
        line, status = error_line(prog, e)
        if is_internal(e):
            kept = keep_traceback(prog, e, run_dir())
            line += f" (traceback: {kept}; --debug shows it here)" if kept else " (rerun with --debug for the traceback)"
        _quiet_shutdown()
        if is_rank_zero() or not (isinstance(e, ConfigError) or getattr(e, "everywhere", False)):  # (the same on every rank)
            print(line, file=sys.stderr, flush=True)
        else:
            time.sleep(RANK_ZERO_GRACE_S)
        return status


def _quiet_shutdown() -> None:
    """Tear the process group down so torch does not add its own warning lines on exit."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings elsewhere; quiet megatron's and vLLM's chatter."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s r{rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("megatron", "megatron.core.rerun_state_machine", "vllm", "torch.distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_main(prog: str, doc: str, argv: list[str] | None, *, program: Callable[[], type[Program]],
             report: Callable[[dict[str, Any]], None] | None = None) -> NoReturn:
    """A program entry point's whole `main`: the CPU environment, the recipe (`parse`, with
    `--check`), logging for this rank, then the program's run (`run_program`) under
    `run_guarded` (one line and exit status 2 for the user's errors), `report` given rank
    0's summary; exits with its status (0 when it returns)."""
    cpu_environment()
    args, cfg = parse(argv, prog, doc, program)
    setup_logging(int(os.environ.get("RANK", "0")))

    def body() -> int:
        summary = run_program(program(), cfg)
        if summary and report is not None:
            report(summary)
        return 0

    status = run_guarded(prog, body, debug=args.debug, run_dir=lambda: cfg.run_dir)
    skip_final_collections()  # (at the exit that follows: seconds of exit-time collection saved)
    sys.exit(status)


def run_program(program: type[Program], cfg: Config) -> dict[str, Any]:
    """A whole run of `program` on this rank: the program built from the recipe
    (`Program.build`, which runs its checks first) and driven by the one run loop; rank 0
    returns the summary."""
    from moe_rl.config import to_dict
    from moe_rl.loop import RunLoop

    compile_off_without_gpu()
    return RunLoop(program.build(cfg), run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()


def compile_off_without_gpu() -> None:
    """torch.compile off where there is no NVIDIA GPU (slow to start, nothing to gain on the
    CPU path); left alone on a GPU machine, where vLLM compiles its model and 0.26 refuses to
    start with dynamo disabled ("aot_compile is not supported", seen on an H100)."""
    if shutil.which("nvidia-smi") is None:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def cpu_environment() -> None:
    """Environment the CPU path needs before torch/megatron/vLLM start (idempotent), and
    silence for the third-party warnings known to be harmless, matched by their exact text
    (`moe_rl.runtime.noise`: every other warning still shows). MOE_RL_WARNINGS=1 or --verbose shows
    them all."""
    from moe_rl.runtime.noise import silence_known_noise

    compile_off_without_gpu()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's start-up warnings for an in-process engine without a tokenizer (chat-template
    # warm-up, thread binding, EOS from the tokenizer) are expected here; errors still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    silence_known_noise()


def resolve_recipe(cfg: Config, given: frozenset[str] = frozenset(), start_from: str = "") -> Config:
    """The recipe (as `load_recipe` gives it: typed, not validated) with the starting
    checkpoint's model and a concrete tokenizer, validated (`moe_rl.recipe_source`);
    `start_from`: the recipe a model conflict's error suggests. The order matters: the model
    section is config.json's before any model or parallel check runs."""
    import dataclasses

    from moe_rl.config import validate
    from moe_rl.recipe_source import resolved_model, resolved_tokenizer

    init = cfg.run.init_checkpoint
    cfg = dataclasses.replace(cfg, model=resolved_model(cfg.model, init, given, start_from),
                              task=dataclasses.replace(cfg.task, tokenizer=resolved_tokenizer(cfg.task.tokenizer, init)))
    validate(cfg)
    return cfg


def load_resolved(path: str | Path | None, overrides: list[str] | None = None, program: str = "") -> Config:
    """The recipe at `path` with `overrides`, resolved and validated: what `program`'s CLI
    runs (`python -m <program>`)."""
    from moe_rl.config import load_recipe
    from moe_rl.recipe_source import hf_recipe

    cfg, given = load_recipe(path, overrides)
    suggest = hf_recipe(program, cfg.rl.uses_critic)
    if path and Path(path).name == Path(suggest).name:
        suggest = ""  # already that recipe: the conflicting keys are the command line's
    return resolve_recipe(cfg, given, suggest)
