"""Mismatch metrics per bucket of response position or sampler probability.

Each bucket is [e_i, e_{i+1}), the last one closed [e_{n-2}, e_{n-1}] so that probability 1
is counted. Per bucket: num_tokens; token-means of |dp|, k1, k3 and the three threshold
fractions; dp_max_mean (max |dp| over a sequence's tokens in that bucket, averaged over the
sequences that have any). Empty bucket: NaN (undefined), except num_tokens = 0. The sums
are bincounts over one flat key per (sequence, bucket): no Python loop over tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_PROB_EDGES = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)

# token-level columns of the bucket tables, in display order
BUCKET_COLUMNS = (
    "num_tokens",
    "dp_mean",
    "dp_max_mean",
    "k1",
    "k3",
    "frac_tis_capped",
    "frac_outside_icepop",
    "frac_dlogp_gt_ln2",
)


def default_position_edges(T: int) -> tuple[float, ...]:
    """(0, 4, 8, 16, ..., 2^k) with 2^k >= T: every position 0..T-1 falls in a bucket."""
    edges = [0.0, 4.0]
    while edges[-1] < T:
        edges.append(edges[-1] * 2)
    return tuple(edges)


def check_edges(
    name: str, edges: Sequence[float], lo: float, hi: float | None
) -> tuple[float, ...]:
    e = tuple(float(x) for x in edges)
    if len(e) < 2 or any(b <= a for a, b in itertools.pairwise(e)):
        raise ValueError(f"{name} must be >= 2 strictly increasing numbers, got {e}")
    if e[0] < lo or (hi is not None and e[-1] > hi):
        raise ValueError(f"{name} must lie in [{lo}, {hi if hi is not None else 'inf'}], got {e}")
    return e


def bucket_labels(edges: Sequence[float]) -> list[str]:
    """'[a, b)' per bucket, the last one '[a, b]' (it is closed)."""
    n = len(edges) - 1
    return [f"[{edges[i]:g}, {edges[i + 1]:g}{']' if i == n - 1 else ')'}" for i in range(n)]


@dataclass(frozen=True)
class BucketTable:
    """Mismatch metrics per bucket of `by` ("position" or "sampler_prob")."""

    by: str
    edges: tuple[float, ...]
    columns: dict[str, Tensor]  # name -> [num_buckets]; BUCKET_COLUMNS order
    num_outside: Tensor  # valid tokens in no bucket

    @property
    def labels(self) -> list[str]:
        return bucket_labels(self.edges)

    def rows(self) -> list[dict[str, float | str]]:
        """One dict per bucket: {"bucket": label, column: float, ...} (NaN where empty)."""
        cols = {k: v.double().cpu().tolist() for k, v in self.columns.items()}
        return [
            {"bucket": label, **{k: cols[k][i] for k in cols}}
            for i, label in enumerate(self.labels)
        ]


def bucket_index(x: Tensor, edges: tuple[float, ...], valid: Tensor) -> Tensor:
    """Bucket id per element; the extra id len(edges)-1 collects invalid / out-of-range."""
    nb = len(edges) - 1
    e = torch.tensor(edges, dtype=x.dtype, device=x.device)
    idx = torch.bucketize(x, e, right=True) - 1  # e[i] <= x < e[i+1]  ->  i
    idx = torch.where(x == e[-1], nb - 1, idx)  # the last bucket is closed
    ok = valid & (idx >= 0) & (idx < nb)
    return torch.where(ok, idx, nb)


# bit b of a token's flag code <-> the b-th threshold flag (capped, outside band, > ln 2)
_FLAG_COLUMNS = ("frac_tis_capped", "frac_outside_icepop", "frac_dlogp_gt_ln2")


def bucket_table(
    by: str,
    edges: tuple[float, ...],
    idx_BT: Tensor,
    abs_dp_BT: Tensor,
    d_BT: Tensor,
    k3_BT: Tensor,
    flags_BT: Tensor,  # int64 code: sum_b 2^b * flag_b
    n_valid: Tensor,
) -> BucketTable:
    """Bucket sums via bincount over one flat key per (sequence, bucket).

    bincount is the fastest scatter-sum on CPU; the three 0/1 flags ride along in one
    unweighted count over (key, flag code) instead of three weighted ones.
    """
    nb = len(edges) - 1
    B = idx_BT.shape[0]
    n_keys = B * (nb + 1)
    seq_B1 = torch.arange(B, device=idx_BT.device)[:, None] * (nb + 1)
    key_N = (seq_B1 + idx_BT).reshape(-1)
    n_codes = 1 << len(_FLAG_COLUMNS)

    def per_bucket(weights_BT: Tensor) -> Tensor:  # [nb] sum over tokens in each bucket
        s = torch.bincount(key_N, weights=weights_BT.reshape(-1), minlength=n_keys)
        return s.view(B, nb + 1)[:, :nb].sum(0)

    codes_Sc = torch.bincount(
        key_N * n_codes + flags_BT.reshape(-1), minlength=n_keys * n_codes
    ).view(B, nb + 1, n_codes)[:, :nb]
    count_Bb = codes_Sc.sum(-1).to(abs_dp_BT.dtype)
    count_b = count_Bb.sum(0)
    codes_bc = codes_Sc.sum(0).to(abs_dp_BT.dtype)
    bits_cF = torch.tensor(
        [[(c >> f) & 1 for f in range(len(_FLAG_COLUMNS))] for c in range(n_codes)],
        dtype=abs_dp_BT.dtype,
        device=key_N.device,
    )
    flags_bF = codes_bc @ bits_cF

    def mean(sum_b: Tensor) -> Tensor:  # NaN marks an empty bucket
        return torch.where(count_b > 0, sum_b / count_b.clamp_min(1), torch.nan)

    # per (sequence, bucket) max |dp|, then the mean over sequences present in the bucket
    max_S = torch.zeros(n_keys, dtype=abs_dp_BT.dtype, device=key_N.device)
    max_S.scatter_reduce_(0, key_N, abs_dp_BT.reshape(-1), reduce="amax")
    present_Bb = (count_Bb > 0).to(abs_dp_BT.dtype)
    n_seq_b = present_Bb.sum(0)
    dp_max_mean_b = torch.where(
        n_seq_b > 0,
        (max_S.view(B, nb + 1)[:, :nb] * present_Bb).sum(0) / n_seq_b.clamp_min(1),
        torch.nan,
    )

    columns = {
        "num_tokens": count_b,
        "dp_mean": mean(per_bucket(abs_dp_BT)),
        "dp_max_mean": dp_max_mean_b,
        "k1": mean(-per_bucket(d_BT)),
        "k3": mean(per_bucket(k3_BT)),
        **{name: mean(flags_bF[:, f]) for f, name in enumerate(_FLAG_COLUMNS)},
    }
    return BucketTable(by=by, edges=edges, columns=columns, num_outside=n_valid - count_b.sum())
