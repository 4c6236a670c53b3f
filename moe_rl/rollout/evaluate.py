"""Held-out evaluation with the rollout engines: greedy accuracy and pass@k.

    report = evaluate_problems(sampler, encoder, tok, task, problems, k=4, temperature=1.0,
                               max_new_tokens=512, seed=0)
    report.metrics()   # {"eval/greedy_acc": ..., "eval/pass@1": ..., "eval/pass@4": ..., ...}

Per problem: one greedy response (temperature 0) and `k` sampled ones at the training
temperature. greedy_acc is the mean greedy reward; pass@1 the mean sampled reward; pass@k
the fraction of problems with at least one of the k samples correct (reward >= 0.5 counts as
correct: the math reward is 0/1, a user reward may be graded). Rewards come from the task,
so evaluation scores exactly as training does, cuts at task.reward_timeout_s included
(`eval/reward_timeouts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moe_rl.sampler.base import base_seeds

if TYPE_CHECKING:
    from moe_rl.config import RunConfig, SamplerConfig, TaskConfig
    from moe_rl.rollout.engines import Engines
    from moe_rl.rollout.episodes import Episodes
    from moe_rl.sampler.base import Generates
    from moe_rl.tasks.base import Problem, Task
    from moe_rl.tokenization.prompts import PromptEncoder

CORRECT = 0.5
"""A reward at or above this counts as a correct answer for pass@k."""


@dataclass
class EvalReport:
    """Sums over the evaluated problems (summable across engines)."""

    k: int
    problems: int = 0
    greedy_correct: float = 0.0
    sample_reward: float = 0.0
    any_correct: int = 0
    response_tokens: int = 0
    reward_timeouts: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: EvalReport) -> None:
        self.problems += other.problems
        self.greedy_correct += other.greedy_correct
        self.sample_reward += other.sample_reward
        self.any_correct += other.any_correct
        self.response_tokens += other.response_tokens
        self.reward_timeouts += other.reward_timeouts
        self.examples += other.examples

    def metrics(self) -> dict[str, float]:
        n = max(self.problems, 1)  # (an empty share reports zeros, never a division by 0)
        return {"eval/greedy_acc": self.greedy_correct / n, "eval/pass@1": self.sample_reward / (n * self.k),
                f"eval/pass@{self.k}": self.any_correct / n, "eval/problems": float(self.problems),
                "eval/mean_response_tokens": self.response_tokens / (n * (self.k + 1)),
                "eval/reward_timeouts": float(self.reward_timeouts)}


def evaluate_problems(sampler: Generates, encoder: PromptEncoder, tok: Any, task: Task, problems: Sequence[Problem],
                      *, k: int,
                      temperature: float, top_p: float, max_new_tokens: int, seed: int,
                      examples: int = 4, episodes: Episodes | None = None) -> EvalReport:
    """Greedy + `k` sampled responses per problem on `sampler`, scored by `task`; with
    `episodes` (`moe_rl.rollout.episodes.Episodes`), whole multi-turn episodes scored by their
    environments."""
    report = EvalReport(k)
    if not problems:
        return report
    if episodes is not None:
        greedy_groups = episodes.run(sampler, problems, 1, 0.0, 1.0, base_seeds(seed, len(problems), 1))
        sampled_groups = episodes.run(sampler, problems, k, temperature, top_p, base_seeds(seed + 1, len(problems), k))
        greedy_ids = [r.tokens for g in greedy_groups for r in g.responses]
        sampled_ids = [r.tokens for g in sampled_groups for r in g.responses]
        greedy_r = [x for g in greedy_groups for x in g.episode_rewards()[0]]
        sampled_r = [x for g in sampled_groups for x in g.episode_rewards()[0]]
        greedy_texts = [tok.decode(ids) for ids in greedy_ids]
    else:
        prompt_ids = [encoder.encode(p) for p in problems]
        greedy = sampler.generate(prompt_ids, n=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
                                  prompt_seeds=base_seeds(seed, len(problems), 1))
        sampled = sampler.generate(prompt_ids, n=k, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, prompt_seeds=base_seeds(seed + 1, len(problems), k))
        greedy_ids, sampled_ids = greedy.response_token_ids, sampled.response_token_ids
        greedy_texts = [tok.decode(r) for r in greedy_ids]
        texts = [tok.decode(r) for r in sampled_ids]
        scores = task.score(list(problems) + [problems[i] for i in sampled.prompt_index], greedy_texts + texts)
        greedy_r, sampled_r = scores.values[:len(problems)], scores.values[len(problems):]
        report.reward_timeouts = scores.timeouts
    report.problems = len(problems)
    report.greedy_correct = float(sum(r >= CORRECT for r in greedy_r))
    report.sample_reward = float(sum(sampled_r))
    report.any_correct = sum(any(r >= CORRECT for r in sampled_r[i * k:(i + 1) * k]) for i in range(len(problems)))
    report.response_tokens = sum(map(len, greedy_ids)) + sum(map(len, sampled_ids))
    report.examples = [{"prompt": p.prompt, "answer": p.answer, "greedy": t, "reward": r}
                       for p, t, r in list(zip(problems, greedy_texts, greedy_r))[:examples]]
    return report


class HeldOut:
    """A run's held-out evaluation (`task.eval_data_path`, `run.eval_k`, `run.eval_max_problems`)
    on the rollout engines, each engine taking its block of the problems; an engine that
    fails is rebuilt with the weights it had and the evaluation runs again."""

    def __init__(self, task_cfg: TaskConfig, run_cfg: RunConfig) -> None:
        self.task_cfg, self.run_cfg = task_cfg, run_cfg
        self._problems: tuple[Any, list[Any]] | None = None
        self.last_examples: list[dict[str, Any]] = []
        """The last evaluation's examples (what the run loop logs)."""

    def problems(self) -> tuple[Any, list[Any]]:
        """(the evaluation's task, its problems), built once."""
        if self._problems is None:
            import dataclasses

            from moe_rl.config import ConfigError
            from moe_rl.tasks import make_task

            task = make_task(dataclasses.replace(self.task_cfg, data_path=self.task_cfg.eval_data_path))
            problems = list(getattr(task, "problems", None) or [])
            if not problems:
                raise ConfigError(f"task.eval_data_path={self.task_cfg.eval_data_path}: the task {task.name!r} "
                                  "has no fixed problems to evaluate on; use task.name=dataset")
            self._problems = (task, problems[: self.run_cfg.eval_max_problems or None])
        return self._problems

    def evaluate(self, step: int, engines: Engines, encoder: PromptEncoder, tok: Any, sampler_cfg: SamplerConfig,
                 episodes: Episodes | None = None) -> dict[str, float]:
        """Greedy accuracy and pass@k after step `step`. Collective: every rank returns the same."""
        from moe_rl.rollout.engine_faults import EngineFault, GenerateError, GenerateOnly

        task, problems = self.problems()
        engines.wake()
        p, s, k = engines.placement, sampler_cfg, self.run_cfg.eval_k
        share = p.share(len(problems))
        while True:  # (a failed engine, rebuilt with the weights it had, evaluates again)
            mine, fault = EvalReport(k), None
            try:
                if engines.sampler is not None:
                    mine = evaluate_problems(GenerateOnly(engines.guarded(f"evaluating after step {step}")), encoder, tok, task,
                                             [problems[i] for i in share], k=k, temperature=s.temperature,
                                             top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                             seed=self.run_cfg.seed + 7 * share.start, episodes=episodes)
            except GenerateError as e:  # (the engine's failure, not the rewards')
                fault = EngineFault(p.rank, str(e))
            parts = p.all_gather((fault, engines.restarts.used))
            faults = [f for f, _ in parts if f is not None]
            if not faults:
                break
            engines.restarts.used = max(used for _, used in parts)  # (the engines' count: a learner rank sees no rollout's)
            engines.recover(faults, f"evaluating after step {step}", everywhere=True)
        total = EvalReport(k)
        for part in p.gather(mine):
            total.add(part)
        self.last_examples = total.examples
        return total.metrics()
