"""Cost of `policy_loss` forward + backward per objective, relative to the cheapest possible
policy-gradient loss on the same tensors.

    python -m bench.run_all objectives            # B=64, T=4096, fp32, CPU
    python -m bench.run_all objectives --quick    # smoke-sized

Baseline: the plain masked mean `-(logprobs * advantages * mask).sum() / mask.sum()`,
forward + backward. Each objective runs with its defaults (rspo with a router shift), plus
two rows with the shared machinery switched on (TIS correction + k3 KL penalty). Timings
are interleaved in rounds (baseline, then each objective) so that load drifting on a shared
machine hits all rows alike; the table gives the ratio of the fastest runs (contention only
ever adds time) and of the medians. With more than one torch thread the whole table is
measured again single-threaded (steadier when cores are shared).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch

from moe_rl.objectives import OBJECTIVES, PolicyBatch, policy_loss
from moe_rl_testing.bench_common import markdown_table, time_fn, write_results


def make_inputs(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    logp = -3 * torch.rand(B, T, generator=g)
    return {
        "logprobs": logp.requires_grad_(True),
        "old_logprobs": logp.detach() + 0.05 * torch.randn(B, T, generator=g),
        "rollout_logprobs": logp.detach() + 0.05 * torch.randn(B, T, generator=g),
        "ref_logprobs": logp.detach() + 0.1 * torch.randn(B, T, generator=g),
        "router_shift": 0.5 + 0.5 * torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "response_mask": mask,
    }


def cases(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    logp, adv, mask = x["logprobs"], x["advantages"], x["response_mask"]

    def baseline() -> None:
        logp.grad = None
        (-(logp * adv[:, None] * mask).sum() / mask.sum()).backward()

    def case(name: str, with_shift: bool, **hp: object) -> Callable[[], None]:
        batch = PolicyBatch(
            logp,
            x["old_logprobs"],
            adv,
            mask,
            rollout_logprobs=x["rollout_logprobs"],
            ref_logprobs=x["ref_logprobs"] if hp.get("kl_coef") else None,
            router_shift=x["router_shift"] if with_shift else None,
        )

        def run() -> None:
            logp.grad = None
            policy_loss(name, batch, **hp).loss.backward()

        return run

    out = {"baseline (masked mean of logprobs * A)": baseline}
    for name, spec in OBJECTIVES.items():
        out[name] = case(name, spec.needs_router_shift)
    out["grpo + tis + k3 KL"] = case("grpo", False, rollout_correction="tis", kl_coef=0.01)
    out["rspo + tis + k3 KL"] = case("rspo", True, rollout_correction="tis", kl_coef=0.01)
    return out


def measure(
    fns: dict[str, Callable[[], None]], rounds: int, iters: int
) -> dict[str, list[dict[str, float]]]:
    """time_fn stats per round for each case, the cases interleaved within each round."""
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_fn(fn, warmup=2, iters=iters))
    return samples


def main(quick: bool = False) -> None:
    B, T = (8, 256) if quick else (64, 4096)
    rounds, iters = (2, 3) if quick else (7, 10)
    fns = cases(make_inputs(B, T))
    threads = torch.get_num_threads()
    runs = {threads: measure(fns, rounds, iters)}
    if threads > 1:  # single-threaded too: steadier on a shared machine
        torch.set_num_threads(1)
        try:
            runs[1] = measure(fns, rounds, iters)
        finally:
            torch.set_num_threads(threads)
    base_key = next(iter(fns))
    rows, results = [], {}
    for name in fns:
        spec = OBJECTIVES.get(name.split(" ")[0])
        row = [name, spec.level if spec and name != base_key else "-"]
        results[name] = {}
        for n_threads, samples in runs.items():
            # Best run (what the code costs; contention only ever adds) and median of the
            # per-round medians (what a loaded machine shows), each relative to the baseline's.
            best = min(r["min_s"] for r in samples[name])
            med = statistics.median(r["median_s"] for r in samples[name])
            best_base = min(r["min_s"] for r in samples[base_key])
            med_base = statistics.median(r["median_s"] for r in samples[base_key])
            row += [best * 1e3, best / best_base, med / med_base]
            results[name][f"threads_{n_threads}"] = {
                "min_s": best,
                "median_s": med,
                "ratio_min": best / best_base,
                "ratio_median": med / med_base,
                "rounds": samples[name],
            }
        rows.append(row)
    header = ["loss", "level"]
    for n in runs:
        header += [f"best ms ({n} thr)", f"x baseline, best ({n} thr)", f"x baseline, median ({n} thr)"]
    table = markdown_table(header, rows)
    load = os.getloadavg()
    notes = (
        f"B={B}, T={T}, fp32, CPU; responses of random length in [T/4, T]; forward + backward; "
        f"{rounds} interleaved rounds of {iters} runs each; 'best' is the fastest run, 'median' "
        f"the median of the per-round medians. Load average at the end: "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} CPUs."
    )
    print(table)
    print(notes)
    write_results(
        "objectives",
        {"B": B, "T": T, "dtype": "float32", "rounds": rounds, "iters": iters,
         "loadavg": load, "results": results},
        table,
        notes,
    )


if __name__ == "__main__":
    main()
