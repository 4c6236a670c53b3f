"""How much of the return's variance a value function could explain, on a synthetic digit
task (exact-match reward), for a given policy: the ceiling of PPO's `critic/explained_variance`.

    python tools/value_ceiling.py --policy runs/tiny_ppo/hf [--task reverse] [--prompts 192] [--samples 8]

Under an exact-match reward the best possible value of a state (the prompt and the response
so far) follows from the policy itself: 0 once the prefix has left the answer, else the
probability that the policy writes the rest of the answer and then EOS, which is the product
of its teacher-forced probabilities of those tokens. The tool samples `--samples` responses
per prompt at temperature 1 (transformers, the policy's Hugging Face directory), and prints
the explained variance of Monte-Carlo returns (the reward, on every response token: gamma 1)
by three values, each read at the state before the token, as PPO's critic is:

    exact      the best possible value above;
    prefix     whether the prefix is still the answer's, times the success rate of the
               sampled responses with a correct prefix at that position and operand length
               (what a critic knows that spots a wrong digit but not the policy's confidence);
    length     the success rate by position and operand length alone.

A measured critic's explained variance is read against `exact` (docs/ppo_dpo.md).

    python tools/value_ceiling.py --policy runs/tiny_ppo/hf --critic runs/tiny_ppo/checkpoints/step_000200

`--critic` also scores the same rollouts with a PPO run's critic (the checkpoint's
`critic.*` weights, on one process; `--policy` should be the same step's policy, e.g. the
run's `hf` export beside its last checkpoint) and prints its explained variance, then where
its error is: the states still on the answer, and those that have left it, by the token
that left it (a prompt token out of place, a token not in the prompt, a token where the
answer had ended), each with its share of the tokens, the mean value and return, its share
of the squared error, and the explained variance if those states were valued 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from moe_rl.config import TaskConfig
from moe_rl.programs.ppo.gae import explained_variance
from moe_rl.tasks import make_task


class Rollout(NamedTuple):
    """One sampled response: token ids of the prompt, the answer (EOS included) and the
    response, the policy's teacher-forced probability of each answer token, the reward."""

    prompt: list[int]
    answer: list[int]
    answer_p: list[float]
    response: list[int]
    reward: float


def on_track(answer_ids: list[int], response_ids: list[int]) -> list[bool]:
    """Per response token: is the response before it still the answer's start (with room for
    the token in the answer)?"""
    return [t < len(answer_ids) and response_ids[:t] == answer_ids[:t] for t in range(len(response_ids))]


def exact_values(answer_ids: list[int], answer_p: list[float], response_ids: list[int]) -> list[float]:
    """The value of the state before each response token: the product of the policy's
    teacher-forced probabilities of the answer tokens still to write (`answer_p`, one per
    token of `answer_ids`, EOS included) while the response is on track, and 0 from the
    token after the first one that leaves it."""
    return [math.prod(answer_p[t:]) if ok else 0.0 for t, ok in enumerate(on_track(answer_ids, response_ids))]


ON_TRACK = "on track"
OFF_KINDS = ("a prompt token out of place", "a token not in the prompt", "past the answer's end")
"""How a response leaves the answer: by the first token that differs from the answer's."""
OFF_TRACK = "off track (every kind)"


def state_kinds(prompt_ids: list[int], answer_ids: list[int], response_ids: list[int]) -> list[str]:
    """Per response token, the state before it: `ON_TRACK`, or once the response has left
    the answer, how it left (`OFF_KINDS`, by the first differing token: one of the prompt's,
    one absent from it, or any token where the answer's EOS was due)."""
    tracked = on_track(answer_ids, response_ids)
    first_off = next((t for t, ok in enumerate(tracked) if not ok), len(response_ids))
    k = first_off - 1  # (the first token that differs: the state after it is the first off track)
    if k < 0 or first_off == len(response_ids):
        return [ON_TRACK] * len(response_ids)
    kind = (OFF_KINDS[2] if k >= len(answer_ids) - 1 else
            OFF_KINDS[0] if response_ids[k] in prompt_ids else OFF_KINDS[1])
    return [ON_TRACK if ok else kind for ok in tracked]


def critic_values(checkpoint: Path, rollouts: list[Rollout], rows_per_pass: int = 256) -> list[list[float]]:
    """The values of a PPO run's critic (`checkpoint`: one of the run's checkpoints, read
    with its own config.yaml, on one process) at every response token of `rollouts`."""
    from moe_rl.batch import TokenBatch
    from moe_rl.config import ParallelConfig, load_config
    from moe_rl.learner import Learner, init_distributed, load_checkpoint, parallel_layout
    from moe_rl.learner.critic import Critic
    from moe_rl.step_batch import StepBatch

    cfg = load_config(checkpoint / "config.yaml")
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(micro_batch_size=cfg.parallel.micro_batch_size))
    init_distributed()
    out: list[list[float]] = []
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        actor = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=1)
        critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=1)
        load_checkpoint(actor, checkpoint, load_optimizer=False, components={"critic": critic}, restore_rng=False)
        for i in range(0, len(rollouts), rows_per_pass):
            part = rollouts[i:i + rows_per_pass]
            tokens = TokenBatch.from_lists([r.prompt for r in part], [r.response for r in part])
            values_BT = critic.values(StepBatch.whole(tokens))
            out += [values_BT[b, :len(r.response)].tolist() for b, r in enumerate(part)]
    return out


def critic_report(rollouts: list[Rollout], values: list[list[float]]) -> dict[str, dict[str, float]]:
    """The critic's explained variance of the Monte-Carlo returns (`"all"`) and, per kind of
    state (`state_kinds`), its share of the tokens, mean value and return, share of the
    squared error, and the explained variance with those states valued 0."""
    kinds = np.array([k for r in rollouts for k in state_kinds(r.prompt, r.answer, r.response)])
    v = np.array([x for row in values for x in row])
    r = np.array([ro.reward for ro in rollouts for _ in ro.response])
    err = (r - v) ** 2
    report = {"all": {"tokens": float(len(r)), "explained_variance": _ev(r, v)}}
    for kind, m in [(k, kinds == k) for k in (ON_TRACK, *OFF_KINDS)] + [(OFF_TRACK, kinds != ON_TRACK)]:
        if m.any():
            report[kind] = {"share": float(m.mean()), "value": float(v[m].mean()), "return": float(r[m].mean()),
                            "error_share": float(err[m].sum() / max(err.sum(), 1e-30)),
                            "valued_0": _ev(r, np.where(m, 0.0, v)) if kind != ON_TRACK else float("nan")}
    return report


def _ev(returns: np.ndarray, values: np.ndarray) -> float:
    r = torch.from_numpy(returns)
    return explained_variance(torch.from_numpy(values), r, torch.ones_like(r, dtype=torch.bool))


def _table_values(keys: list[tuple], hits: list[float], on_track: list[bool]) -> np.ndarray:
    """Per token: the success rate of the tokens with the same key (among on-track ones when
    `on_track` is given per token), 0 off track."""
    total, count = defaultdict(float), defaultdict(int)
    for k, r, ok in zip(keys, hits, on_track):
        if ok:
            total[k] += r
            count[k] += 1
    return np.array([total[k] / count[k] if ok and count[k] else 0.0 for k, ok in zip(keys, on_track)])


def sample_rollouts(policy: Path, task_name: str, prompts: int, samples: int, seed: int,
                    with_answer_p: bool = True) -> Iterator[Rollout]:
    """`samples` responses (token ids, EOS included when written) to each of `prompts`
    problems drawn from `seed`, at temperature 1 with transformers, with their rewards and
    (`with_answer_p`) the policy's teacher-forced probabilities of the answer's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    task = make_task(TaskConfig(name=task_name))
    eos = tok.eos_token_id
    with torch.no_grad():
        for problem in task.sample(prompts, seed):
            prompt = tok(problem.prompt, add_special_tokens=False).input_ids
            answer = [*tok(task.completion(problem), add_special_tokens=False).input_ids, eos]
            answer_p: list[float] = []
            if with_answer_p:
                logp = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0].float(), -1)
                answer_p = [float(logp[len(prompt) - 1 + j, a].exp()) for j, a in enumerate(answer)]
            out = model.generate(torch.tensor([prompt] * samples), attention_mask=torch.ones(samples, len(prompt),
                                 dtype=torch.long), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=len(answer) + 8, eos_token_id=eos, pad_token_id=eos)
            for row in out[:, len(prompt):].tolist():
                response = row[: row.index(eos) + 1] if eos in row else row
                reward = task.reward(problem, tok.decode(response, skip_special_tokens=True))
                yield Rollout(prompt, answer, answer_p, response, reward)


def measure(rollouts: list[Rollout]) -> dict[str, float]:
    returns, exact, keys, tracked = [], [], [], []
    for ro in rollouts:
        returns += [ro.reward] * len(ro.response)
        exact += exact_values(ro.answer, ro.answer_p, ro.response)
        keys += [(len(ro.answer), t) for t in range(len(ro.response))]
        tracked += on_track(ro.answer, ro.response)
    r = np.array(returns)
    return {"reward": float(np.mean(r)), "tokens": float(len(r)),
            "exact": _ev(r, np.array(exact)),
            "prefix": _ev(r, _table_values(keys, returns, tracked)),
            "length": _ev(r, _table_values(keys, returns, [True] * len(keys)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="value_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True, help="the policy's Hugging Face directory")
    ap.add_argument("--task", default="reverse", choices=["reverse", "sort", "add"])
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--critic", type=Path, help="a PPO run's checkpoint: score its critic on the same rollouts")
    args = ap.parse_args(argv)
    for flag in ("prompts", "samples"):
        if getattr(args, flag) < 1:
            print(f"value_ceiling: --{flag} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if not (args.policy / "config.json").is_file():
        print(f"value_ceiling: --policy {args.policy} is not a Hugging Face directory (no config.json); "
              "export one with tools/convert_checkpoint.py --to hf", file=sys.stderr)
        return 2
    if args.critic is not None and (why := _not_a_critic(args.critic)):
        print(f"value_ceiling: --critic {args.critic} {why}; give one of a PPO run's <run>/checkpoints/step_N",
              file=sys.stderr)
        return 2
    rollouts = list(sample_rollouts(args.policy, args.task, args.prompts, args.samples, args.seed))
    m = measure(rollouts)
    print(f"{args.policy}: reward (token-weighted) {m['reward']:.3f} over {int(m['tokens'])} response tokens")
    print(f"explained variance of Monte-Carlo returns: exact {m['exact']:.3f} | prefix {m['prefix']:.3f} | "
          f"length {m['length']:.3f}")
    if args.critic is not None:
        from moe_rl.checkpoints.errors import CheckpointError
        from moe_rl.config import ConfigError

        try:
            values = critic_values(args.critic, rollouts)
        except (CheckpointError, ConfigError) as e:
            print(f"value_ceiling: --critic {args.critic}: {e}", file=sys.stderr)
            return 2
        _print_report(args.critic, critic_report(rollouts, values))
    return 0


def _not_a_critic(checkpoint: Path) -> str:
    """Why `checkpoint` holds no PPO critic ("" when it does)."""
    from moe_rl.checkpoints import CONFIG_FILE
    from moe_rl.checkpoints.directories import is_checkpoint, read_meta

    if not is_checkpoint(checkpoint) or not (checkpoint / CONFIG_FILE).is_file():
        return "is not a moe_rl checkpoint"
    return "" if "critic" in read_meta(checkpoint) else "holds no critic (it was saved by a run without rl.advantage=gae)"


def _print_report(checkpoint: Path, report: dict[str, dict[str, float]]) -> None:
    print(f"critic {checkpoint}: explained variance {report['all']['explained_variance']:.3f}")
    print("| state | share of tokens | mean value | mean return | share of squared error | EV if valued 0 |")
    print("|---|---|---|---|---|---|")
    for kind, row in report.items():
        if kind != "all":
            zeroed = "-" if kind == ON_TRACK else f"{row['valued_0']:.3f}"
            print(f"| {kind} | {row['share']:.3f} | {row['value']:.2f} | {row['return']:.2f} | "
                  f"{row['error_share']:.2f} | {zeroed} |")


if __name__ == "__main__":
    sys.exit(main())
