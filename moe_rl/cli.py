"""Command-line plumbing shared by the entry points (`moe_rl.train`, `moe_rl.sft`,
`moe_rl.plan`, tools).

    python -m moe_rl.train --config examples/tiny_rspo.yaml rl.objective=gspo run.steps=20
    python -m moe_rl.train --help-config        # every key, its type, default and docstring

Errors: `run_guarded(prog, fn, debug=args.debug)` runs a program's body and turns what
escapes it into ONE line on stderr, `<prog>: error: <what, naming the field, file or row,
and the fix>`, with exit status 2 for the user's input (config, files, checkpoints, a full
disk) and 1 for anything else (a bug: the line says to rerun with --debug). `--debug` (or
MOE_RL_DEBUG=1) lets the traceback through instead.

    def main(argv=None) -> int:
        args = parser().parse_args(argv)        # add_debug_flag(parser) adds --debug
        return run_guarded(PROG, lambda: run(args), debug=args.debug)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

from moe_rl.checkpoint_files import CheckpointError, causes, disk_full
from moe_rl.checkpoint_files import describe as describe_error
from moe_rl.config import Config, ConfigError, describe, load_recipe

T = TypeVar("T")
USER_ERROR, INTERNAL_ERROR = 2, 1


def add_debug_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--debug", action="store_true",
                    help="show the full traceback of an error instead of one line (also MOE_RL_DEBUG=1)")


def parse(argv: list[str] | None, prog: str, doc: str) -> tuple[argparse.Namespace, Config]:
    """`--config FILE` plus `section.key=value` overrides -> a validated Config. A bad
    recipe exits with status 2 and the ConfigError message, before anything is built."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe (sections: model, parallel, optimizer, rl, ...)")
    ap.add_argument("--help-config", action="store_true", help="list every config key and exit")
    add_debug_flag(ap)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe())
        sys.exit(0)
    try:
        from moe_rl.recipe_source import resolve_recipe

        cfg = resolve_recipe(*load_recipe(args.config, args.overrides))
    except ConfigError as e:
        if _debugging(args.debug):
            raise
        print(f"{prog}: config error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(USER_ERROR)
    return args, cfg


def _debugging(flag: bool) -> bool:
    return flag or os.environ.get("MOE_RL_DEBUG") == "1"


def _is_user_error(e: BaseException) -> bool:
    """Errors about the user's input or machine, as opposed to bugs: our own error types,
    ValueError / OSError (bad values, missing or unwritable files), safetensors' and torch
    DCP's / megatron's checkpoint errors (a damaged or mismatched checkpoint)."""
    if isinstance(e, ConfigError | CheckpointError | ValueError | OSError):
        return True
    name, module = type(e).__name__, type(e).__module__
    return name in ("SafetensorError", "CheckpointException", "CheckpointingException") or module.startswith(
        ("safetensors", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing"))


def error_line(prog: str, e: BaseException) -> tuple[str, int]:
    """The one line printed for `e`, and the exit status. Our own errors already say what
    happened; a full disk is named as such whatever error reported it."""
    if not isinstance(e, ConfigError | CheckpointError) and disk_full(e):
        where = next((c.filename for c in causes(e) if getattr(c, "filename", None)), None)
        return (f"{prog}: error: disk full{f' writing {where}' if where else ''}: free space there or write "
                "elsewhere (run.output_dir / --out / --dst)", USER_ERROR)
    if _is_user_error(e):
        return f"{prog}: error: {describe_error(e)}", USER_ERROR
    return f"{prog}: internal error: {describe_error(e)} (rerun with --debug for the traceback)", INTERNAL_ERROR


def run_guarded(prog: str, fn: Callable[[], T], *, debug: bool = False) -> T | int:
    """`fn()`; on an error, print `error_line` and return its exit status instead (with
    `debug`, re-raise). KeyboardInterrupt is one line and status 130."""
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
        _quiet_shutdown()
        print(line, file=sys.stderr)
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


def cpu_environment() -> None:
    """Environment the CPU path needs before torch/megatron/vLLM start (idempotent), and
    silence for the import-time warnings third-party stacks print on every start (missing
    Apex/TE fallbacks, deprecations inside torch.distributed.checkpoint and vLLM): they are
    not actionable for a user of this package. Set MOE_RL_WARNINGS=1 to see them."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's start-up warnings for an in-process engine without a tokenizer (chat-template
    # warm-up, thread binding, EOS from the tokenizer) are expected here; errors still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if os.environ.get("MOE_RL_WARNINGS") != "1":
        for module in ("megatron", "torch.distributed", "vllm", "transformers"):
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=module)
