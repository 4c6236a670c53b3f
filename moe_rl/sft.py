"""Supervised warm start: turn a random tiny MoE into a base policy with partial success.

    python -m moe_rl.sft --config examples/tiny_sft.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.sft --config examples/tiny_sft.yaml parallel.expert_model_parallel_size=2

Each step draws `sft.batch_size` problems from the task and minimises the token-mean
negative log-likelihood of the reference completion (+ EOS) given the prompt, on the same
megatron learner the RL loop uses. Every `sft.eval_every` steps it measures the expected
exact-match reward of sampling at temperature 1 on a fixed held-out set,
mean_i exp(sum_t log pi(answer_it)), which is exactly the reward RL starts from, and stops
once it reaches `sft.target_reward`. The final model (no optimizer state) is saved with
`save_checkpoint` to `sft.output` (an existing checkpoint there is replaced once the new
one is complete; any other existing directory is refused). The run directory gets
config.yaml and sft_summary.json when the run finished. Ctrl-C or SIGTERM stops it after
the step in progress, like the target reward, and saves the model so far the same way
(exit status 130 / 143; `moe_rl.interrupt`). Errors are one line (exit 2);
`--debug` shows the traceback. `--check [--nproc N]` only checks the recipe and its
inputs for N ranks and prints one line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moe_rl.atomic import atomic_write_text
from moe_rl.batch import TokenBatch
from moe_rl.cli import cpu_environment, parse, run_guarded, setup_logging
from moe_rl.config import Config, save_config
from moe_rl.interrupt import StopOnSignal, StoppedBySignal
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem, Task
from moe_rl.tasks.tokenizer import Tokenizer
from moe_rl.tokenization import load_tokenizer

log = logging.getLogger("moe_rl.sft")


def encode_problems(problems: list[Problem], task: Task, tok: Tokenizer, seq_multiple: int) -> TokenBatch:
    """Prompt ids + reference completion ids (ending in EOS) for each problem."""
    pairs = [tok.encode_example(p.prompt, task.completion(p)) for p in problems]
    return TokenBatch.from_lists([a for a, _ in pairs], [b for _, b in pairs], pad_id=tok.pad_id,
                                 seq_multiple=seq_multiple)


def nll_loss(batch: TokenBatch):
    """Token-mean NLL with the whole batch's token count as normaliser (micro-batch sums
    add up to the whole-batch loss)."""
    from moe_rl.learner import MicroBatchLoss

    total = batch.response_lens_B.sum().clamp(min=1)

    def loss_fn(logp_BT: torch.Tensor, mb) -> MicroBatchLoss:
        mask = mb.batch.response_mask()
        nll = -(logp_BT * mask).sum()
        n = mask.sum()
        return MicroBatchLoss(nll / total, {"nll": nll / n.clamp(min=1)}, weight=n)

    return loss_fn


def expected_reward(learner, batch: TokenBatch) -> float:
    """mean_i exp(sum_t log pi(y_it)) at temperature 1: the exact-match reward of sampling."""
    logp = learner.logprobs(batch)
    seq = (logp * batch.response_mask()).sum(-1)
    return float(torch.exp(seq).mean())


def _check_output(cfg: Config) -> None:
    """sft.output is replaced at the end only when it is a checkpoint (or absent / empty):
    refuse anything else before training rather than after."""
    from moe_rl.checkpoints.directories import is_checkpoint
    from moe_rl.config import ConfigError

    out = Path(cfg.sft.output) if cfg.sft.output else cfg.run_dir / "base"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"sft.output={out} is a file; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not is_checkpoint(out):
        raise ConfigError(f"sft.output={out} exists and is not a moe_rl checkpoint (it would be replaced); "
                          "choose another path")


def run(cfg: Config) -> dict:
    from moe_rl.learner import Learner, init_distributed, parallel_layout, save_checkpoint
    from moe_rl.preflight import check_run

    check_run(cfg, int(os.environ.get("WORLD_SIZE", "1")), sft=True)  # once, before anything is built
    _check_output(cfg)
    rank, world = init_distributed(cfg.parallel.distributed_backend)
    setup_logging(rank)
    task, tok = make_task(cfg.task), load_tokenizer(cfg.task.tokenizer, cfg.run.init_checkpoint or None)
    run_dir = cfg.run_dir
    out = Path(cfg.sft.output) if cfg.sft.output else run_dir / "base"
    rng = np.random.default_rng(cfg.run.seed)
    eval_problems = task.sample(cfg.sft.eval_problems, np.random.default_rng(cfg.run.seed + 1_000_003))
    history = []
    t0 = time.perf_counter()
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        torch.manual_seed(cfg.run.seed)
        learner = Learner(cfg, layout, total_updates=cfg.sft.steps)
        eval_batch = encode_problems(eval_problems, task, tok, layout.tp)
        reward = expected_reward(learner, eval_batch)
        history.append({"step": 0, "expected_reward": reward})
        log.info("sft start: %s, expected reward %.3f", layout.name, reward)
        signum = None
        with StopOnSignal() as stop:  # a signal stops after the step in progress, like the target reward
            for step in range(1, cfg.sft.steps + 1):
                batch = encode_problems(task.sample(cfg.sft.batch_size, rng), task, tok, layout.tp)
                metrics = learner.train_step(batch, nll_loss(batch))
                signum = stop.agreed() if step < cfg.sft.steps else None  # collective: every rank stops here
                if signum or step % cfg.sft.eval_every == 0 or step == cfg.sft.steps:
                    reward = expected_reward(learner, eval_batch)
                    history.append({"step": step, "nll": metrics["nll"], "expected_reward": reward,
                                    "seconds": time.perf_counter() - t0})
                    log.info("sft step %d: nll %.3f, expected reward %.3f (%.0fs)", step, metrics["nll"],
                             reward, time.perf_counter() - t0)
                    if signum or (cfg.sft.target_reward and reward >= cfg.sft.target_reward):
                        break
        save_checkpoint(learner, out, extra_meta={"sft": history[-1]}, include_optimizer=False)
    summary = {"steps": history[-1]["step"], "expected_reward": history[-1]["expected_reward"],
               "seconds": time.perf_counter() - t0, "world_size": world, "checkpoint": str(out),
               "history": history, "stopped_by": signal.Signals(signum).name if signum else None}
    if rank == 0:
        save_config(cfg, run_dir / "config.yaml")  # only once the run succeeded
        atomic_write_text(run_dir / "sft_summary.json", json.dumps(summary, indent=2) + "\n")
        if signum:
            log.warning("sft stopped by %s after step %d of %d; the model so far is saved in %s (SFT does not "
                        "resume: run it again to train from the start)", summary["stopped_by"], summary["steps"],
                        cfg.sft.steps, out)
        else:
            log.info("sft done: %d steps, expected reward %.3f, checkpoint %s", summary["steps"],
                     summary["expected_reward"], out)
    if signum:
        raise StoppedBySignal(signum)
    return summary


def main(argv: list[str] | None = None) -> None:
    cpu_environment()
    args, cfg = parse(argv, "python -m moe_rl.sft", __doc__, sft=True)
    sys.exit(run_guarded("python -m moe_rl.sft", lambda: _run_cli(cfg), debug=args.debug))


def _run_cli(cfg: Config) -> int:
    run(cfg)
    return 0


if __name__ == "__main__":
    main()
