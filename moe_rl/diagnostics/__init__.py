"""Sampler-learner mismatch: metrics (pure torch, cheap enough for every RL step) and the
report writer (JSON, Markdown, PNG plots; matplotlib is imported only when plotting).
"""

from moe_rl.diagnostics.metrics import (
    BucketTable,
    MismatchResult,
    TokenArrays,
    compute_mismatch,
    default_position_edges,
)
from moe_rl.diagnostics.report import write_report

__all__ = [
    "BucketTable",
    "MismatchResult",
    "TokenArrays",
    "compute_mismatch",
    "default_position_edges",
    "write_report",
]
