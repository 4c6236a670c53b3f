"""The ablation settings: which objective, replay and correction each run uses.

Every setting trains `examples/ablations.yaml` from the same warm start; only these
overrides differ. Off-policy means `OFF_POLICY_UPDATES` mini-batch updates per rollout,
the regime where the router moves between the pass that scored the rollout (old logprobs,
old routing) and the later updates: the one RSPO, GSPO and routing replay are about.
On-policy (one update per rollout) every method's ratio is 1 and gamma is 1, so GRPO
stands in for all of them there, as the reference.
"""

from __future__ import annotations

OFF_POLICY_UPDATES = 4

METHODS: dict[str, list[str]] = {
    "grpo": ["rl.objective=grpo", "rl.replay=none"],
    "grpo-r2": ["rl.objective=grpo", "rl.replay=R2"],
    "grpo-r3": ["rl.objective=grpo", "rl.replay=R3"],
    "gspo": ["rl.objective=gspo", "rl.replay=none"],
    "gmpo": ["rl.objective=gmpo", "rl.replay=none"],
    "rspo-post": ["rl.objective=rspo", "rl.replay=none", "rl.objective_args.rspo.gamma_placement=post_clip"],
    "rspo-pre": ["rl.objective=rspo", "rl.replay=none", "rl.objective_args.rspo.gamma_placement=pre_clip"],
    "sapo": ["rl.objective=sapo", "rl.replay=none"],
}
"""Off-policy methods, each run with and without TIS."""

CORRECTIONS: dict[str, list[str]] = {"": ["rl.rollout_correction=none"], "-tis": ["rl.rollout_correction=tis"]}

REFERENCE = "grpo-on"
"""The on-policy run every off-policy setting is read against."""

DEFAULT_SEEDS = (1, 2, 3)


def settings() -> dict[str, list[str]]:
    """name -> overrides: `<method>[-tis]-off` for each method, and the on-policy reference."""
    out = {REFERENCE: [*METHODS["grpo"], *CORRECTIONS[""], "rl.num_minibatches=1"]}
    for method, m in METHODS.items():
        for suffix, c in CORRECTIONS.items():
            out[f"{method}{suffix}-off"] = [*m, *c, f"rl.num_minibatches={OFF_POLICY_UPDATES}"]
    return out


def parse_seeds(text: str) -> tuple[int, ...]:
    """'1,2,3' or '1-5' -> seeds; a clear error otherwise."""
    seeds: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            seeds.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise ValueError(f"SEEDS={text!r}: give integers, e.g. 1,2,3 or 1-5") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"SEEDS={text!r}: give at least one seed, each once, e.g. 1,2,3")
    return tuple(seeds)
