"""`make agent-demo` beside `make tool-demo`: the same calculator steps through the agent
program (examples/agents/calculator_agent.py on the gateway) and through the in-process tool
environment, from the two runs' own metrics.

    make tool-demo agent-demo && python -m bench.generators.agent_demo
    python -m bench.generators.agent_demo --tool runs/tool_demo --agent runs/agent_demo

Per step: reward, turns and tool calls per episode of each run (the same seed draws the same
problems and sampler seeds, so on one engine the two runs decode the same episodes while
their weights agree), and the gateway's overhead: the agent run's `time/sample` (the rollout,
HTTP and agent included) minus the tool run's. Writes bench/results/agent_demo.{json,md}.
Timings are of whatever machine ran the two demos, and noisy on a shared one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_rl_testing.bench_common import markdown_table, write_results

KEYS = ("reward/mean", "rollout/turns_mean", "rollout/tool_calls_mean", "time/sample")


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"bench.generators.agent_demo: {path} does not exist; run the demo first")
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward/mean" in r]


def compare(tool: list[dict[str, Any]], agent: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps both runs logged, side by side, and the mean gateway overhead per step."""
    steps = sorted({int(r["step"]) for r in tool} & {int(r["step"]) for r in agent})
    by_t, by_a = {int(r["step"]): r for r in tool}, {int(r["step"]): r for r in agent}
    rows = [{"step": s, **{f"tool {k}": by_t[s].get(k) for k in KEYS}, **{f"agent {k}": by_a[s].get(k) for k in KEYS},
             "overhead_s": by_a[s]["time/sample"] - by_t[s]["time/sample"]} for s in steps]
    if not rows:
        raise SystemExit("bench.generators.agent_demo: the two runs share no step")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"steps": len(rows), "tool_reward_mean": mean("tool reward/mean"),
            "agent_reward_mean": mean("agent reward/mean"), "overhead_s_per_step": mean("overhead_s"),
            "same_rewards_steps": sum(r["tool reward/mean"] == r["agent reward/mean"] for r in rows), "rows": rows}


def main(argv: list[str] | None = None, quick: bool = False) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", default="runs/tool_demo", help="make tool-demo's run directory")
    ap.add_argument("--agent", default="runs/agent_demo", help="make agent-demo's run directory")
    args = ap.parse_args(argv)
    out = compare(_rows(Path(args.tool)), _rows(Path(args.agent)))
    table = markdown_table(
        ["step", "reward tool", "reward agent", "turns tool", "turns agent", "calls tool", "calls agent",
         "sample s tool", "sample s agent"],
        [[r["step"], r["tool reward/mean"], r["agent reward/mean"], r["tool rollout/turns_mean"],
          r["agent rollout/turns_mean"], r["tool rollout/tool_calls_mean"], r["agent rollout/tool_calls_mean"],
          r["tool time/sample"], r["agent time/sample"]] for r in out["rows"]])
    notes = (f"{out['steps']} steps; mean reward {out['tool_reward_mean']:.3f} (tool environment) vs "
             f"{out['agent_reward_mean']:.3f} (agent); equal rewards on {out['same_rewards_steps']} steps; gateway "
             f"overhead {out['overhead_s_per_step']:+.2f} s per step (agent time/sample - tool time/sample).")
    write_results("agent_demo", out, table, notes)
    print(notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
