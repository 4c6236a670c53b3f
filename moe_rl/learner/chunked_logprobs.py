"""Log-probs and entropy of target tokens from the output layer's input, chunk by chunk.

The full-vocabulary logits of a micro-batch are the largest tensor in an RL update (32k
tokens x 152k ids x 4 bytes is 20 GB per fp32 copy, and softmax + entropy + their backward
make several). Here the logits only ever exist for one chunk of tokens at a time:

    forward, per chunk c:  z = h_c @ W^T / temperature          [c, V/tp] fp32
                           m = all-reduce MAX of the row max      (vocab-parallel)
                           sum exp(z - m), sum exp(z - m)(z - m), z_target - m
                                 -> one all-reduce SUM            (the owner reads z_target)
    saved for backward:    h, W, targets and per-token lse, entropy (never a logit)
    backward, per chunk:   z recomputed, dL/dz formed in place, then
                           grad_h_c = dL/dz @ W / t,  grad_W += dL/dz^T @ h_c / t

so peak memory above the inputs is two [chunk, V/tp] buffers however many tokens there are.
Under tensor parallelism W is this rank's vocabulary shard and the logits stay sharded; only
per-token scalars cross ranks. Gradients (with dz = dL/dz, p = softmax(z), H the entropy):

    d logp_i / dz_j = [j = target_i] - p_j          d H_i / dz_j = -p_j (log p_j + H_i)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch
import torch.distributed as dist

_ProcessGroup = dist.ProcessGroup | None


def chunked_token_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    tp_group: _ProcessGroup = None,
    vocab_start: int = 0,
    with_entropy: bool = True,
    check_owners: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(target) [N], entropy [N] or None) under softmax(hidden @ W^T / temperature).

    hidden_NH: the output layer's input at the N positions that score a target (already
      selected, e.g. position p scores token p+1), any float dtype, identical on every rank
      of `tp_group`. Under sequence parallel the caller first all-gathers the SP-sharded
      hidden states with megatron's `gather_from_sequence_parallel_region(h,
      tensor_parallel_output_grad=False)`, then selects positions: this function already
      sums the hidden-state gradient over the TP group (every rank gets the full gradient),
      so the gather's backward must only split it, not reduce-scatter it again. Without
      sequence parallel pass the (replicated) hidden states as they are, not through
      `copy_to_tensor_model_parallel_region`, for the same reason.
    weight_VH: this rank's vocabulary shard of the output weight ([V/tp, H];
      `gpt.shared_embedding_or_output_weight()` when embeddings are tied), covering global
      ids [vocab_start, vocab_start + V/tp).
    targets_N: global token ids (int64), each owned by exactly one rank of the group.
    Returns fp32 (fp64 for fp64 inputs) tensors; the math is in fp32 at least, gradients
    come back in the inputs' dtypes. On a GPU, bf16 hidden states and weight multiply on the
    tensor cores with fp32 results (the logits are the fp32 GEMM's up to summation order; the
    logit gradient enters as two bf16 halves, ~2^-16 relative), with no fp32 copy of W; on a
    CPU they are widened once (a transient fp32 copy [V/tp, H] per pass). The backward holds
    the fp32 gradient accumulator [V/tp, H] (and on a GPU one chunk's fp32 product of it).
    Every rank of `tp_group` must make the same call (same N, chunk_tokens, temperature,
    targets): the per-chunk all-reduces must line up. Under pipeline parallel only the last
    stage calls it. Padded vocabulary rows (megatron pads V to a multiple) take part in the
    softmax, as they do in megatron's own cross entropy.
    `check_owners`: count, per token, the shards that hold its target and refuse anything but
    one (a read of a device value, so a GPU waits for its queue); the learner checks its
    targets against the vocabulary on the host instead and turns this off.
    """
    _check_inputs(hidden_NH, weight_VH, targets_N, temperature, chunk_tokens)
    logp_N, entropy_N = _ChunkedLogprobs.apply(
        hidden_NH, weight_VH, targets_N, float(temperature), int(chunk_tokens), tp_group,
        int(vocab_start), (bool(with_entropy), bool(check_owners)),
    )
    return logp_N, (entropy_N if with_entropy else None)


def vocab_shard_start(weight_VH: torch.Tensor, tp_group: _ProcessGroup = None) -> int:
    """First global id of this rank's shard, for megatron's equal vocabulary split
    (VocabUtility.vocab_range_from_per_partition_vocab_size)."""
    return _rank(tp_group) * weight_VH.shape[0]


def _check_inputs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
                  temperature: float, chunk_tokens: int) -> None:
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"hidden_NH [N, H] and weight_VH [V/tp, H] must share H; got "
                         f"{tuple(hidden_NH.shape)} and {tuple(weight_VH.shape)}")
    if targets_N.shape != (hidden_NH.shape[0],) or targets_N.dtype != torch.long:
        raise ValueError(f"targets_N must be int64 [N={hidden_NH.shape[0]}]; got "
                         f"{targets_N.dtype} {tuple(targets_N.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (the caller maps 0 to the full-logits path), "
                         f"got {chunk_tokens}")


def _rank(group: _ProcessGroup) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _world(group: _ProcessGroup) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: _ProcessGroup) -> torch.Tensor:
    """In-place all-reduce over the TP group; nothing to do for no group or a group of one."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


_HALF = (torch.bfloat16, torch.float16)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 (so gradcheck can run)."""
    return torch.promote_types(t.dtype, torch.float32)


def _operands(hidden: torch.Tensor, weight_VH: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, weight) as the GEMMs take them: as they are on a GPU when both are the same
    16-bit dtype (a bf16 model's: the tensor cores take them), else widened to `dtype` once
    (a CPU has no faster 16-bit GEMM, and one copy beats one per chunk)."""
    if hidden.is_cuda and hidden.dtype == weight_VH.dtype and weight_VH.dtype in _HALF:
        return hidden, weight_VH
    return hidden.to(dtype), weight_VH.to(dtype)


def _mm_wide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of `_operands`, with an fp32 (or fp64) result. Two 16-bit operands (only ever on a
    GPU) multiply on the tensor cores with fp32 accumulation and an fp32 result: a bf16 x bf16
    product is exact in fp32, so this is the fp32 GEMM of the same values up to summation
    order, at tensor-core speed instead of fp32 SIMT (bench/results/gpu_h100_head.md)."""
    if a.dtype in _HALF:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


def _halves(t_CV: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """fp32 [c, V] `t` as [2c, V] 16-bit rows, hi (t rounded) then lo (t - hi rounded), so
    t - hi - lo ~ 2^-16 |t| for bf16: the logit gradient reaches the tensor cores without
    losing fp32's precision to one bf16 rounding. `t` is consumed (it holds t - hi after),
    so no more than t's bytes are ever added."""
    c = t_CV.shape[0]
    out_KV = torch.empty((2 * c, t_CV.shape[1]), dtype=half, device=t_CV.device)
    out_KV[:c] = t_CV
    out_KV[c:] = t_CV.sub_(out_KV[:c])
    return out_KV


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    z_CV = _mm_wide(h_CH, w_VH.t())
    return z_CV.div_(temperature) if temperature != 1.0 else z_CV


def _owned(targets_C: torch.Tensor, vocab_start: int, local_vocab: int,
           whole: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(whether this rank holds each row's target [c] bool, its local column [c, 1], clamped
    into the shard for the rows it does not hold). Masks, not indices: no host sync on GPU.
    `whole`: one shard holds the whole vocabulary and the caller checked the targets: every
    row is owned (None) and its column is the target itself."""
    if whole:
        return None, targets_C[:, None]
    local_C = targets_C - vocab_start
    owned_C = (local_C >= 0) & (local_C < local_vocab)
    return owned_C, local_C.clamp(0, local_vocab - 1)[:, None]


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, chunk_tokens, tp_group,
                vocab_start, flags):
        check_owners = flags[1]
        dtype = _compute_dtype(hidden_NH)
        h_NH, w_VH = _operands(hidden_NH, weight_VH, dtype)
        N, V_local = hidden_NH.shape[0], weight_VH.shape[0]
        whole = not check_owners and vocab_start == 0 and _world(tp_group) == 1
        chunks = [_forward_chunk(_part(h_NH, lo, lo + chunk_tokens), w_VH, _part(targets_N, lo, lo + chunk_tokens),
                                 temperature, tp_group, vocab_start, whole, flags)
                  for lo in range(0, N, chunk_tokens)]
        empty = hidden_NH.new_zeros(0, dtype=dtype)
        logp_N, lse_N, owners_N, entropy_N = (_joined([c[k] for c in chunks], empty) for k in range(4))
        if check_owners:
            assert owners_N is not None  # (check_owners: counted)
            _check_owners(owners_N, targets_N, vocab_start, V_local)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N, entropy_N)
        ctx.settings = (temperature, chunk_tokens, tp_group, vocab_start, whole)
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N, lse_N, entropy_N = ctx.saved_tensors
        temperature, chunk_tokens, tp_group, vocab_start, whole = ctx.settings
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp_N is None and grad_entropy_N is None) or not (want_h or want_w):
            return (None,) * 8
        dtype = lse_N.dtype
        h_NH, w_VH = _operands(hidden_NH, weight_VH, dtype)
        N = hidden_NH.shape[0]
        grad_h_parts = []
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=dtype, device=weight_VH.device) if want_w else None
        for lo in range(0, N, chunk_tokens):
            hi = min(lo + chunk_tokens, N)
            h_CH = _part(h_NH, lo, hi)
            dz_CV = _grad_logits(
                _chunk_logits(h_CH, w_VH, temperature), _part(lse_N, lo, hi), _part(entropy_N, lo, hi),
                _part(grad_logp_N, lo, hi), _part(grad_entropy_N, lo, hi),
                _owned(_part(targets_N, lo, hi), vocab_start, w_VH.shape[0], whole),
            )
            if temperature != 1.0:
                dz_CV.div_(temperature)  # z = h W^T / t
            halves = w_VH.dtype in _HALF
            if halves:  # dz as hi and lo rows: each gradient is one tensor-core GEMM (K = 2c for dW)
                dz_CV, h_CH = _halves(dz_CV, w_VH.dtype), torch.cat([h_CH, h_CH])
            if want_h:
                g_KH = _mm_wide(dz_CV, w_VH)
                grad_h_parts.append(g_KH[: hi - lo] + g_KH[hi - lo:] if halves else g_KH)
            if grad_w_VH is not None and halves:  # an fp32 product of 16-bit operands, then accumulated
                grad_w_VH.add_(_mm_wide(dz_CV.t(), h_CH))
            elif grad_w_VH is not None:  # accumulated in place: no [V, H] temporary
                grad_w_VH.addmm_(dz_CV.t(), h_CH)
            del dz_CV  # before the next chunk's logits exist: two [c, V] fp32 buffers at most
        grad_h_NH = None
        if want_h:  # each rank saw only its vocabulary shard's share of dL/dh
            grad_h_NH = _joined(grad_h_parts, torch.zeros(hidden_NH.shape, dtype=dtype, device=hidden_NH.device))
            assert grad_h_NH is not None  # (want_h: every chunk made its part)
            _all_reduce(grad_h_NH, dist.ReduceOp.SUM, tp_group)
            grad_h_NH = grad_h_NH.to(hidden_NH.dtype)
        if grad_w_VH is not None:
            grad_w_VH = grad_w_VH.to(weight_VH.dtype)
        return grad_h_NH, grad_w_VH, None, None, None, None, None, None


def _forward_chunk(h_CH: torch.Tensor, w_VH: torch.Tensor, targets_C: torch.Tensor, temperature: float,
                   tp_group: _ProcessGroup, vocab_start: int, whole: bool,
                   flags: tuple[bool, bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk's (log-prob, log-sum-exp, owner count or None, entropy or None), [c] each:
    its logits exist only here. Under TP the per-token sums cross ranks in one all-reduce."""
    with_entropy, check_owners = flags
    z_CV = _chunk_logits(h_CH, w_VH, temperature)
    max_C = _all_reduce(z_CV.amax(dim=1), dist.ReduceOp.MAX, tp_group)
    z_CV.sub_(max_C[:, None])  # z - max <= 0: exp cannot overflow, log-probs stay <= 0
    owned_C, col_C1 = _owned(targets_C, vocab_start, w_VH.shape[0], whole)
    target_C = z_CV.gather(1, col_C1).squeeze(1)  # shifted target logit
    rows = [target_C if owned_C is None else torch.where(owned_C, target_C, 0.0)]
    exp_CV = torch.exp(z_CV)
    rows.append(exp_CV.sum(dim=1))
    if check_owners:
        assert owned_C is not None  # (check_owners: never the whole vocabulary)
        rows.append(owned_C.to(z_CV.dtype))  # owner count: must come out exactly 1 per token
    if with_entropy:  # sum_v e^(z-m) (z-m), one row dot product each: no [c, V] temporary
        rows.append(torch.bmm(exp_CV.unsqueeze(1), z_CV.unsqueeze(2)).view(-1))
    del exp_CV, z_CV
    if _world(tp_group) > 1:  # one all-reduce for every sum
        block_KC = _all_reduce(torch.stack(rows), dist.ReduceOp.SUM, tp_group)
        rows = list(block_KC.unbind(0))
    log_sum_C = rows[1].log()  # >= 0: the max itself contributes exp(0) = 1
    # H = log sum e^(z-m) - E_p[z - m]; both terms >= 0
    entropy_C = log_sum_C - rows[-1] / rows[1] if with_entropy else None
    return rows[0] - log_sum_C, max_C + log_sum_C, rows[2] if check_owners else None, entropy_C


@overload
def _part(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor: ...
@overload
def _part(t: None, lo: int, hi: int) -> None: ...
def _part(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """t[lo:hi] (t itself when that is all of it: a slice is an op too)."""
    if t is None or (lo == 0 and hi >= t.shape[0]):
        return t
    return t[lo:hi]


def _joined(parts: Sequence[torch.Tensor | None], empty: torch.Tensor) -> torch.Tensor | None:
    """The chunks' pieces as one tensor (`empty` for no chunk; None for pieces not made)."""
    made = [p for p in parts if p is not None]
    if not parts:
        return empty
    if not made:
        return None
    return made[0] if len(made) == 1 else torch.cat(made)


def _grad_logits(z_CV: torch.Tensor, lse_C: torch.Tensor, entropy_C: torch.Tensor | None,
                 g_logp_C: torch.Tensor | None, g_entropy_C: torch.Tensor | None,
                 owned: tuple[torch.Tensor | None, torch.Tensor]) -> torch.Tensor:
    """dL/dz for one chunk, built in z's buffer plus one more [c, V] buffer:
    g_logp (onehot - p) - g_H p (log p + H)."""
    log_p_CV = z_CV.sub_(lse_C[:, None])
    p_CV = torch.exp(log_p_CV)
    dz_CV = None
    if g_entropy_C is not None:
        assert entropy_C is not None  # (an entropy gradient: the forward computed it)
        dz_CV = log_p_CV.add_(entropy_C[:, None]).mul_(p_CV).mul_(-g_entropy_C[:, None])
    if g_logp_C is not None:
        p_CV.mul_(-g_logp_C[:, None])
        dz_CV = p_CV if dz_CV is None else dz_CV.add_(p_CV)
        owned_C, col_C1 = owned
        g_C = g_logp_C if owned_C is None else torch.where(owned_C, g_logp_C, 0.0)
        dz_CV.scatter_add_(1, col_C1, g_C.to(dz_CV.dtype)[:, None])
    assert dz_CV is not None  # (the caller has a gradient of one output at least)
    return dz_CV


def _check_owners(owners_N: torch.Tensor, targets_N: torch.Tensor, vocab_start: int, local_vocab: int) -> None:
    """Every target id must belong to exactly one rank's shard; otherwise its log-prob would
    silently read 0 (out of range) or a sum of two logits (overlapping shards)."""
    if owners_N.numel() and not bool((owners_N == 1).all()):
        bad = int((owners_N != 1).nonzero()[0, 0])
        raise ValueError(
            f"target id {int(targets_N[bad])} (token {bad}) is held by {int(owners_N[bad])} vocabulary "
            f"shards, expected exactly 1 (this rank holds [{vocab_start}, {vocab_start + local_vocab})): "
            "targets must be global ids below the vocabulary size and vocab_start must match the shard"
        )
