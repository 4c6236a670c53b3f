"""Plot metrics of a run's metrics.jsonl against the step (a PNG for the docs).

    python tools/plot_metrics.py --metrics runs/tiny_dpo/metrics.jsonl --out /tmp/dpo.png \
        --keys eval/rewards/accuracies,rewards/accuracies [--title "make dpo-demo"]

Each key is one line over the rows that have it; a key no row has is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows holding `key`."""
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics", required=True, help="a run's metrics.jsonl")
    ap.add_argument("--keys", required=True, help="comma-separated metric names")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="", help="the plot's title")
    args = ap.parse_args(argv)
    path = Path(args.metrics)
    if not path.is_file():
        print(f"{ap.prog}: error: {path}: no such file", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for key in args.keys.split(","):
        steps, values = series(rows, key)
        if not steps:
            print(f"{ap.prog}: error: no row of {path} has {key!r}", file=sys.stderr)
            return 2
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(args.title or str(path))
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
