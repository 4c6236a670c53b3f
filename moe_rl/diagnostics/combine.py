"""Mismatch summaries of disjoint parts of a batch (one per data-parallel rank) combined into
the summary of the whole batch, from the counts each part carries: token means weighted by
`num_tokens`, sequence means by `num_sequences`, the maximum by max. Equal (to rounding) to
`compute_mismatch` on the whole batch, so the trainer reduces scalars, never rows."""

from __future__ import annotations

from collections.abc import Sequence

from moe_rl.diagnostics.metrics import PREFIX, ratio_moments

SEQUENCE_MEANS = ("dp_mean", "dp_max_mean", "log_ppl_diff", "chi2_seq")
"""Summary values averaged over sequences (the others, but counts and dp_max, over tokens)."""


def combine_mismatch_summaries(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One `MismatchResult.summary()` from the summaries of disjoint parts of a batch."""
    if len(parts) == 1:
        return dict(parts[0])
    tokens = [p[f"{PREFIX}num_tokens"] for p in parts]
    seqs = [p[f"{PREFIX}num_sequences"] for p in parts]
    out: dict[str, float] = {f"{PREFIX}num_tokens": sum(tokens), f"{PREFIX}num_sequences": sum(seqs)}
    for key in parts[0]:
        name = key[len(PREFIX):]
        if key in out:
            continue
        if name == "dp_max":
            out[key] = max(p[key] for p in parts)
            continue
        weights = seqs if name in SEQUENCE_MEANS else tokens
        total = sum(weights)
        out[key] = sum(p[key] * w for p, w in zip(parts, weights)) / total if total > 0 else 0.0
    if f"{PREFIX}ess_token" in out:  # (not a mean: rebuilt from the combined means of r and r^2)
        moments = ratio_moments(out[f"{PREFIX}ratio_mean"], out[f"{PREFIX}chi2_token"] + 1.0, sum(tokens) > 0)
        out.update({f"{PREFIX}{k}": float(v) for k, v in moments.items()})
    return out
