"""Sampler-learner mismatch: metrics (pure torch, cheap enough for every RL step) and the
report writer (JSON, Markdown, PNG plots; matplotlib is imported only when plotting).

A library: tensors in, numbers and files out. It imports nothing of the learner or the
samplers; the application that starts them and measures a checkpoint is `moe_rl.mismatch`.
"""

from moe_rl.diagnostics.buckets import BucketTable, default_position_edges
from moe_rl.diagnostics.combine import combine_mismatch_summaries
from moe_rl.diagnostics.metrics import MismatchResult, TokenArrays, compute_mismatch
from moe_rl.diagnostics.report import write_report

__all__ = [
    "BucketTable",
    "MismatchResult",
    "TokenArrays",
    "combine_mismatch_summaries",
    "compute_mismatch",
    "default_position_edges",
    "write_report",
]
