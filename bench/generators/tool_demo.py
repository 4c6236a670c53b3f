"""What `make tool-demo` achieved: the tool task's reward against wall-clock time, from the
run's own metrics (the warm start, `moe_rl/assets/tool_base`, not counted).

    make tool-demo && python -m bench.generators.tool_demo
    python -m bench.generators.tool_demo --run runs/tool_demo --minutes 10

Elapsed time at a step is the sum of the steps' `time/step` up to it (the run loop's
wall-clock per step: rollout, scoring, update, weight sync; not the process start). The
start reward is the mean over the first `--window` steps, the reward at a time the mean over
the last `--window` steps finished by then (step rewards are means over 16 prompts x 8
episodes, noisy). Writes bench/results/tool_demo.{json,md} and docs/tool_demo.png (reward,
tool calls and turns per episode against minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

KEYS = ("reward/mean", "rollout/tool_calls_mean", "rollout/turns_mean", "rollout/truncated_frac",
        "rollout/tool_parse_errors")


def summarize(rows: list[dict[str, Any]], minutes: float, window: int) -> dict[str, Any]:
    """Reward at the start and by `minutes`, with the curve (elapsed minutes per step)."""
    rows = [r for r in rows if "reward/mean" in r]
    if len(rows) < window:
        raise SystemExit(f"bench.generators.tool_demo: the run has {len(rows)} RL steps, fewer than --window={window}")
    elapsed, t = [], 0.0
    for r in rows:
        t += float(r.get("time/step", 0.0))
        elapsed.append(t / 60)
    within = [i for i, m in enumerate(elapsed) if m <= minutes]
    if len(within) < window:
        raise SystemExit(f"bench.generators.tool_demo: fewer than {window} steps finished within {minutes} minutes")
    mean = lambda idx: sum(rows[i]["reward/mean"] for i in idx) / len(idx)  # noqa: E731
    start, end = mean(range(window)), mean(within[-window:])
    return {"minutes": minutes, "window": window, "steps_within": len(within), "reward_start": start,
            "reward_at_minutes": end, "gain": end - start, "total_minutes": elapsed[-1],
            "curve": [{"step": r["step"], "minutes": m, **{k: r.get(k) for k in KEYS}} for r, m in zip(rows, elapsed)]}


def plot(summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = summary["curve"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=110)
    x = [c["minutes"] for c in curve]
    ax.plot(x, [c["reward/mean"] for c in curve], label="reward/mean", marker="o", markersize=3)
    ax.plot(x, [c["rollout/tool_calls_mean"] for c in curve], label="rollout/tool_calls_mean")
    ax.plot(x, [c["rollout/turns_mean"] - 1 for c in curve], label="rollout/turns_mean - 1", linestyle=":")
    if summary["minutes"] <= summary["total_minutes"]:
        ax.axvline(summary["minutes"], color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel(f"minutes of RL (2 CPU cores; the warm start not counted): reward {summary['gain']:+.2f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("make tool-demo: calculator task, RSPO, episodes of up to 3 turns")
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/tool_demo", help="the demo's run directory")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    args = ap.parse_args(argv)
    metrics = Path(args.run) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"bench.generators.tool_demo: {metrics} does not exist: run `make tool-demo` first", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    s = summarize(rows, args.minutes, args.window)
    table = markdown_table(["", "value"], [
        [f"reward, first steps (mean of {s['window']})", f"{s['reward_start']:.3f}"],
        [f"reward by {s['minutes']:g} min (mean of the last {s['window']} steps by then)", f"{s['reward_at_minutes']:.3f}"],
        ["gain", f"{s['gain']:+.3f}"],
        [f"steps within {s['minutes']:g} min", str(s["steps_within"])],
        ["whole run", f"{len(s['curve'])} steps, {s['total_minutes']:.1f} min"]])
    write_results("tool_demo", s, "# make tool-demo (bench/generators/tool_demo.py)\n\n" + table + "\n")
    plot(s, ROOT / "docs" / "tool_demo.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
