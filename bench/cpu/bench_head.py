"""The chunked log-prob head on its own: bf16 operands on the tensor cores (fp32 results)
against the same function on fp32 operands (fp32 GEMMs), with errors against fp64.

    python -m bench.cpu.bench_head [--tokens 16384] [--hidden 2048] [--vocab 32768 151936] [--quick]
        # -> bench/results/<device>_head.md (and .json); <device> is gpu_h100 on an H100, cpu here

Why: bench/device/profile_gpu.py found fp32 SIMT GEMMs of the head taking about half of a bf16
step's GPU time at one layer and a 32k vocabulary, and the head's share grows with the vocabulary
(Qwen3's is 151936). Each row: forward + backward seconds (median of `--iters`), tokens/s,
and against the fp64 computation of the same bf16 values: max |dlogp|, max |dentropy|, and
the relative error (max abs / max abs of the reference) of dL/dh and dL/dW for a random
upstream gradient.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from moe_rl_testing.bench_common import markdown_table, synced, time_fn, write_results


def _case(tokens: int, hidden: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """bf16 hidden states and weight at a trained model's scale (logits of a few units)."""
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, device=device).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden ** -0.5 * 3).bfloat16()
    return {"h": h, "w": w, "targets": torch.randint(0, vocab, (tokens,), generator=g, device=device),
            "g_logp": torch.randn(tokens, generator=g, device=device),
            "g_entropy": torch.randn(tokens, generator=g, device=device) * 0.1}


def _pass(case: dict[str, torch.Tensor], dtype: torch.dtype, chunk: int) -> dict[str, torch.Tensor]:
    from moe_rl.learner.chunked_logprobs import chunked_token_logprobs

    h = case["h"].to(dtype, copy=True).requires_grad_(True)  # fresh leaves: no gradient accumulates
    w = case["w"].to(dtype, copy=True).requires_grad_(True)  # across the timed passes
    logp, entropy = chunked_token_logprobs(h, w, case["targets"], chunk_tokens=chunk)
    torch.autograd.backward([logp, entropy], [case["g_logp"].to(logp.dtype), case["g_entropy"].to(logp.dtype)])
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad_h": h.grad, "grad_w": w.grad}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-300))


def run(tokens: int, hidden: int, vocab: int, chunk: int, iters: int) -> list[dict[str, Any]]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = _case(tokens, hidden, vocab, device)
    ref = _pass(case, torch.float64, chunk)
    rows = []
    for name, dtype in (("fp32 operands (fp32 GEMMs)", torch.float32), ("bf16 operands (tensor cores)", torch.bfloat16)):
        got = synced(_pass, case, dtype, chunk)
        timing = time_fn(lambda dtype=dtype: synced(_pass, case, dtype, chunk), warmup=1, iters=iters)
        rows.append({"vocab": vocab, "operands": name, "fwd_bwd_s": timing["median_s"],
                     "tokens_per_s": tokens / timing["median_s"],
                     "max_abs_dlogp": float((got["logp"].double() - ref["logp"]).abs().max()),
                     "max_abs_dentropy": float((got["entropy"].double() - ref["entropy"]).abs().max()),
                     "grad_h_rel": _rel(got["grad_h"], ref["grad_h"]), "grad_w_rel": _rel(got["grad_w"], ref["grad_w"])})
        print(rows[-1], flush=True)
        del got
    return rows


def main(quick: bool = False, argv: list[str] | None = None) -> None:
    """The benchmark with `argv`'s flags (none: the defaults; `quick`: the smoke size)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="response tokens (default 16384: 8 x 2048)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3-30B-A3B)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936], help="vocabulary sizes")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (parallel.logprob_chunk_tokens)")
    ap.add_argument("--iters", type=int, default=5, help="timed passes per row (median)")
    ap.add_argument("--quick", action="store_true", help="256 tokens, hidden 64, vocab 512 (a smoke test)")
    args = ap.parse_args([*(argv or []), *(["--quick"] if quick else [])])
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.chunk, args.iters = 256, 64, [512], 64, 2
    rows = [r for v in args.vocab for r in run(args.tokens, args.hidden, v, args.chunk, args.iters)]
    table = markdown_table(
        ["vocab", "operands", "fwd+bwd s", "tokens/s", "x fp32", "max |dlogp|", "max |dentropy|", "dL/dh rel err",
         "dL/dW rel err"],
        [[r["vocab"], r["operands"], r["fwd_bwd_s"], r["tokens_per_s"],
          r["tokens_per_s"] / next(b["tokens_per_s"] for b in rows if b["vocab"] == r["vocab"]),
          r["max_abs_dlogp"], r["max_abs_dentropy"], r["grad_h_rel"], r["grad_w_rel"]] for r in rows])
    print(table)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    short = "gpu_h100" if "H100" in device else ("cpu" if device == "cpu" else "gpu")
    notes = (f"`python -m bench.cpu.bench_head --tokens {args.tokens} --hidden {args.hidden} --vocab "
             f"{' '.join(map(str, args.vocab))} --chunk {args.chunk} --iters {args.iters}` on {device}: "
             "`chunked_token_logprobs` forward + backward (log-prob and entropy gradients) on bf16 values, "
             "errors against the same values in fp64.")
    print(write_results(f"{short}_head", {"rows": rows, "quick": args.quick, "device": device}, table, notes))


if __name__ == "__main__":
    main(argv=sys.argv[1:])
