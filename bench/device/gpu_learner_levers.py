"""Device check 2 (issue 45): the learner's throughput levers, one row each, measured in one
process on the same weights and batch, at the Qwen3-30B-A3B layer shape on one GPU.

    python -m bench.device.gpu_learner_levers [--layers 4] [--batch 32] [--seq 2048] [--iters 3]
        # -> bench/results/gpu_<device>_learner_levers.md/.json, and the table as the
        #    "Settings ablation" section of gpu_<device>_learner.md
    python -m bench.device.gpu_learner_levers --dry-run --out DIR      # CPU: the same rows, tiny shape

Written, not yet run on a GPU (the CPU dry run runs in the suite: tests/integration/bench/test_device_checks.py).

Rows, cumulative: each adds one lever to the last row kept (a lever is kept when its row ran
and was not slower; the fused permutation is kept regardless, for the exact on-policy ratio):
baseline (one 2048-token sequence per micro-batch, unfused permutation: today's learner,
tensor-core head included) -> + a token budget per micro-batch (`parallel.
max_tokens_per_microbatch`) -> + fused permutation -> + gradient-accumulation fusion ->
+ manual GC. Aside rows, measured on top of the kept levers and never carried on, change what
the learner computes or what it can do: CUDA graphs over the router and the MoE
preprocessing (the graphed router replays without the learner's routing taps: no replay,
capture or router shift, so the RL recipes cannot take it), megatron's fused router (it
bypasses RouterReplay: bench-only, no config field), and the capacity-padded dispatch
(sync-free; drops tokens past capacity 1.0) alone and with whole-layer graphs (attention
included: megatron's local graphs take attention only inside a whole layer). Last, fp8
blockwise on the fastest kept row (its speed over that row's: the issue's fp8 >= 1.0x bf16 at
>= 64k tokens a step).

Per row: median seconds of a timed `train_step` (`synced`, after one warm-up), tokens/s,
model TFLOP/s and MFU by `moe_rl.plan.flops.train_flops` (megatron's throughput formula, every matmul: QKV and
output projections, causal attention scores and context, the router, the top-k experts'
GEMMs, the output head over the vocabulary; forward + backward = 3x forward) over the GPU's
dense bf16 peak, peak memory, and the on-policy max |dlogp| (the update pass's log-probs
against a scoring pass at the same weights, measured after the timed steps so graphed rows
are measured graphed). A lever this machine cannot run (the preflight's ConfigError, or no
Transformer Engine) is "skipped" with the reason; one that raises is "failed" with its
one-line cause; rows past `--time-limit` are "not run". Dry run (`--dry-run`): the tiny
recipe's shape at 2 layers, fp32, the local spec, 8 x 32 tokens, one timed step a row,
everything under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import to_dict
from moe_rl.plan.flops import PEAK_BF16_TFLOPS, device_short_name, peak_bf16_flops, train_flops
from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, synced, time_fn, write_results

RECIPE = "examples/tiny_grpo.yaml"  # (its objective needs no router shift: the router-graph rows may run)
COMMON = ["rl.capture_routing=false", "parallel.micro_batch_size=1"]
SECTION = "## Settings ablation (bench/device/gpu_learner_levers.py)"


@dataclass(frozen=True)
class Lever:
    name: str
    overrides: list[str]
    kind: str = "lever"  # lever: carried on when kept; aside: measured once, never carried; fp8
    always_keep: bool = False
    tcfg: dict[str, Any] = field(default_factory=dict)  # TransformerConfig fields set after the config (bench-only)
    needs_te: str = ""  # why the lever needs Transformer Engine beyond what the preflight checks


def levers(budget: int, gc_interval: int) -> list[Lever]:
    return [
        Lever("baseline: 1 sequence per micro-batch", []),
        Lever(f"+ token budget ({budget} tokens per micro-batch)", [f"parallel.max_tokens_per_microbatch={budget}"]),
        Lever("+ fused permutation", ["model.moe_permute_fusion=true"], always_keep=True),
        Lever("+ gradient-accumulation fusion", ["model.gradient_accumulation_fusion=true"]),
        Lever(f"+ manual GC (every {gc_interval} updates)", [f"parallel.manual_gc_interval={gc_interval}"]),
        Lever("aside: CUDA graphs over the router and MoE preprocessing (no routing taps)",
              ["model.cuda_graph_scope=moe_router,moe_preprocess"], kind="aside"),
        Lever("aside: fused router (bypasses routing replay)", [], kind="aside", tcfg={"moe_router_fusion": True},
              needs_te="the fused top-k router is Transformer Engine's"),
        Lever("aside: capacity 1.0, padded to capacity (sync-free dispatch, drops tokens)",
              ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"], kind="aside"),
        Lever("aside: capacity-padded + CUDA graphs over whole layers",
              ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true",
               "model.cuda_graph_scope=full"], kind="aside"),
        Lever("fp8 blockwise on the fastest kept row", ["model.fp8=hybrid", "model.fp8_recipe=blockwise"], kind="fp8"),
    ]


def peak_flops() -> float | None:
    """The GPU's dense bf16 peak (FLOP/s): an H100 SXM's for a GPU `moe_rl.plan.flops`
    lacks; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return peak_bf16_flops(torch.cuda.get_device_name()) or PEAK_BF16_TFLOPS["H100"] * 1e12


def device_name() -> str:
    return device_short_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


@dataclass
class Bench:
    """What every row shares: the shape's overrides, the base weights, the batch, the layout."""

    shape: list[str]
    base: Path
    layout: Any
    batch: Any
    adv_B: torch.Tensor
    iters: int
    deadline: float


def row_config(b: Bench, overrides: list[str]) -> Any:
    from moe_rl.config import load_config

    return load_config(ROOT / RECIPE, [*b.shape, *COMMON, *overrides])


@contextlib.contextmanager
def tcfg_override(fields: dict[str, Any]) -> Iterator[None]:
    """The learner's TransformerConfig with `fields` set after it is made (bench-only levers
    that have no config field because they break what the learner guarantees)."""
    from moe_rl.learner import engine

    real = engine.transformer_config

    def patched(model: Any, parallel: Any) -> Any:
        tcfg = real(model, parallel)
        for key, value in fields.items():
            setattr(tcfg, key, value)
        return tcfg

    engine.transformer_config = patched if fields else real
    try:
        yield
    finally:
        engine.transformer_config = real


def measure(b: Bench, cfg: Any, lever: Lever) -> dict[str, Any]:
    """One row: a learner of `cfg` from the base weights, timed steps, the on-policy pair."""
    from bench.device.bench_gpu import reinforce
    from moe_rl.learner import Learner, load_checkpoint

    with tcfg_override(lever.tcfg):
        learner = Learner(cfg.model, cfg.parallel, b.layout, optimizer=cfg.optimizer, total_updates=b.iters + 8)
    load_checkpoint(learner, b.base, load_optimizer=False)
    loss = reinforce(b.batch)
    timing = time_fn(lambda: synced(learner.train_step, b.batch, loss, {"adv_B": b.adv_B}), warmup=1, iters=b.iters)
    step_s = timing["median_s"]
    flops = train_flops(cfg.model, b.batch.total_lens_B.tolist())
    peak = peak_flops()
    out = {"step_s": step_s, "tokens_per_s": int(b.batch.total_lens_B.sum()) / step_s,
           "tflops": flops / step_s / 1e12, "mfu": flops / step_s / peak if peak else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    return {**out, **on_policy(learner, b)}  # (the learner goes with this frame; the caller frees the device)


def on_policy(learner: Any, b: Any) -> dict[str, Any]:
    """max |dlogp| between a scoring pass and the update pass at the same weights (0 when the
    two passes compute alike); its failure is the row's finding, not the row's failure."""
    from bench.device.bench_gpu import reinforce

    try:
        scored = learner.score_whole(b.batch)
        own = learner.update(learner.own_rows(b.batch, {"adv_B": b.adv_B}), reinforce(b.batch))
    except Exception as exc:  # recorded: the timing stands
        return {"on_policy_max_abs_dlogp": None, "on_policy_error": one_line(exc)}
    mask = b.batch.response_mask()
    diff = (own.logp_BT.float() - scored.logp_BT.float()).abs()[mask]
    return {"on_policy_max_abs_dlogp": float(diff.max()), "on_policy_error": ""}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def free_device() -> None:
    from moe_rl.learner.model import release_cuda_graphs

    release_cuda_graphs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_row(b: Bench, lever: Lever, carried: list[str]) -> dict[str, Any]:
    """The row of `lever` on top of the `carried` overrides: ran, skipped (this machine cannot
    run it: the preflight's refusal), failed (the one-line cause) or not run (out of time)."""
    from moe_rl.config import ConfigError
    from moe_rl.learner.model import transformer_engine_available
    from moe_rl.preflight import check_learner_device

    row: dict[str, Any] = {"row": lever.name, "kind": lever.kind, "overrides": [*carried, *lever.overrides],
                           "tcfg": lever.tcfg, "status": "ran", "reason": ""}
    if time.monotonic() > b.deadline:
        return {**row, "status": "not run", "reason": "past --time-limit"}
    try:
        cfg = row_config(b, row["overrides"])
        check_learner_device(cfg)
        if lever.needs_te and not transformer_engine_available():
            raise ConfigError(f"{lever.needs_te}: needs Transformer Engine on a GPU")
    except ConfigError as exc:
        print(f"{lever.name}: skipped: {exc}", flush=True)
        return {**row, "status": "skipped", "reason": str(exc)}
    try:
        row.update(measure(b, cfg, lever))
    except ConfigError as exc:  # (what the learner refuses as it builds: fp8 without TE)
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # recorded and reported (the cause is a result), never swallowed
        row.update(status="failed", reason=one_line(exc))
    finally:
        free_device()
    print(f"{lever.name}: " + (f"{row['tokens_per_s']:.4g} tokens/s, on-policy max |dlogp| "
                               f"{row['on_policy_max_abs_dlogp']}" if row["status"] == "ran"
                               else f"{row['status']}: {row['reason']}"), flush=True)
    return row


def run_all(b: Bench, budget: int, gc_interval: int) -> list[dict[str, Any]]:
    """Every row in order; the kept levers carried on; fp8 on the fastest kept row."""
    carried: list[str] = []
    best: dict[str, Any] | None = None  # the fastest kept row
    last_kept: dict[str, Any] | None = None
    rows = []
    for lever in levers(budget, gc_interval):
        base = best["overrides"] if lever.kind == "fp8" and best else carried
        row = run_row(b, lever, base)
        ran = row["status"] == "ran"
        ref = best if lever.kind == "fp8" else last_kept
        row["gain"] = row["tokens_per_s"] / ref["tokens_per_s"] if ran and ref else None
        row["kept"] = lever.kind == "lever" and ran and (lever.always_keep or not row["gain"] or row["gain"] >= 1.0)
        if row["kept"]:
            carried, last_kept = row["overrides"], row
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]], b: Bench, dry_run: bool) -> tuple[str, str]:
    def num(x: Any, fmt: str = "{:.4g}") -> str:
        return "-" if x is None else fmt.format(x)

    table = markdown_table(
        ["row", "status", "step s", "tokens/s", "x previous kept", "TFLOP/s", "MFU", "peak GiB",
         "on-policy max \\|dlogp\\|", "kept"],
        [[r["row"], r["status"], num(r.get("step_s")), num(r.get("tokens_per_s")), num(r.get("gain")),
          num(r.get("tflops")), num(r.get("mfu"), "{:.1%}"), num(r.get("peak_mem_gib")),
          num(r.get("on_policy_max_abs_dlogp")), "yes" if r.get("kept") else ""] for r in rows])
    why = [f"- {r['row']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    why += [f"- {r['row']}: on-policy pass failed: {r['on_policy_error']}" for r in rows if r.get("on_policy_error")]
    tokens = int(b.batch.total_lens_B.sum())
    notes = (f"{'Dry run (CPU, tiny recipe shape, fp32, local spec)' if dry_run else 'Qwen3-30B-A3B layer shape, bf16, TE spec, one GPU'}"
             f"; {b.batch.batch_size} x {b.batch.seq_len} = {tokens} tokens a step, {b.iters} timed step(s) a row "
             "(median) from the same weights. MFU: `train_flops` (every matmul, output head and router included, "
             "3x the forward) over the dense bf16 peak. 'x previous kept': tokens/s over the last kept row's (fp8: "
             "over the fastest kept row's). Aside rows change what the learner computes or can do (no routing taps "
             "under a graphed router; the fused router bypasses routing replay; capacity drops tokens) and are never "
             "carried on. `python -m bench.device.gpu_learner_levers`." + ("\n\n" + "\n".join(why) if why else ""))
    return table, notes


def upsert_section(path: Path, heading: str, body: str) -> None:
    """`path` with its `heading` section (up to the next `## ` heading) replaced by `body`, or
    appended; the rest of the file stays as it is."""
    from moe_rl.runtime.atomic import atomic_write_text

    text = path.read_text() if path.is_file() else ""
    section = f"{heading}\n\n{body.rstrip()}\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = (text.rstrip() + "\n\n" if text else "") + section
    atomic_write_text(path, text)


def main(dry_run: bool = False, out: str | None = None, layers: int = 4, batch: int = 32, seq: int = 2048,
         iters: int = 3, budget: int = 16384, gc_interval: int = 50, time_limit: float = 480.0) -> int:
    from bench.device.bench_gpu import bench_batch, shape_overrides
    from moe_rl.config import ParallelConfig, load_config
    from moe_rl.learner import Learner, init_distributed, parallel_layout, save_checkpoint
    from moe_rl.learner.model import transformer_engine_available
    from moe_rl.runtime import manual_gc

    if not dry_run and not transformer_engine_available():
        raise SystemExit("gpu_learner_levers needs a CUDA GPU with Transformer Engine (or --dry-run)")
    if dry_run:
        shape, batch, seq, iters, budget = ["model.num_layers=2"], 8, 32, 1, 128
    else:
        shape = [o for o in shape_overrides(layers) if not o.startswith("parallel.micro_batch_size")]
        shape.append(f"model.max_position_embeddings={max(4096, seq)}")
    results = Path(out) / "results" if out else ROOT / "bench" / "results"
    init_distributed()
    cfg = load_config(ROOT / RECIPE, [*shape, *COMMON])
    tokens, adv_B = bench_batch(batch, seq, cfg.model.vocab_size)
    with tempfile.TemporaryDirectory(prefix="levers_") as work, \
            parallel_layout(ParallelConfig(micro_batch_size=1), seed=0) as layout:
        base = Path(work) / "base"
        save_checkpoint(Learner(cfg.model, cfg.parallel, layout), base, recipe=to_dict(cfg))
        free_device()
        b = Bench(shape, base, layout, tokens, adv_B, iters, time.monotonic() + time_limit)
        try:
            rows = run_all(b, budget, gc_interval)
        finally:
            manual_gc.restore()
    table, notes = report(rows, b, dry_run)
    device = device_name()
    print(table)
    data = {"rows": rows, "dry_run": dry_run, "layers": None if dry_run else layers, "batch": batch, "seq": seq,
            "iters": iters, "budget": budget, "shape": shape}
    print(write_results(f"gpu_{device}_learner_levers", data, table, notes, results_dir=results))
    upsert_section(results / f"gpu_{device}_learner.md", SECTION, table + "\n" + notes)
    return 0 if rows[0]["status"] == "ran" else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the tiny recipe's shape, the local spec")
    ap.add_argument("--out", default=None, help="results under OUT/results (default bench/results)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (default 4)")
    ap.add_argument("--batch", type=int, default=32, help="sequences a step (default 32: 64k tokens at 2048)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens a sequence (default 2048)")
    ap.add_argument("--iters", type=int, default=3, help="timed train_steps a row, median reported (default 3)")
    ap.add_argument("--budget", type=int, default=16384, help="the token-budget row's tokens per micro-batch")
    ap.add_argument("--gc-interval", type=int, default=50, help="the manual-GC row's interval in updates")
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds after which rows are not started")
    a = ap.parse_args()
    sys.exit(main(a.dry_run, a.out, a.layers, a.batch, a.seq, a.iters, a.budget, a.gc_interval, a.time_limit))
