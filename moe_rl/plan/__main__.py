"""`python -m moe_rl.plan`: will this recipe fit on its GPUs, and where does a step's time go.

    python -m moe_rl.plan --config examples/gpu/qwen3_30b_a3b.yaml --gpus 16
    python -m moe_rl.plan --config RECIPE run.init_checkpoint=/models/GLM-4.5-Air --gpus 64 --json

Runs on one CPU in seconds: the learner's model is built per distinct rank on the meta
device (docs/plan.md says what is counted and what is estimated). A bad recipe or layout is
one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from moe_rl.cli import cpu_environment
from moe_rl.config import ConfigError, ParallelConfig, SamplerConfig, load_recipe
from moe_rl.plan.hardware import Hardware

PROG = "python -m moe_rl.plan"

# (flag, Hardware field, type, help)
_HW_FLAGS = (
    ("--gpus-per-node", "gpus_per_node", int, "GPUs per node (NVLink inside, InfiniBand across)"),
    ("--gpu-memory-gib", "gpu_memory_gib", float, "usable memory per GPU, GiB"),
    ("--bf16-tflops", "bf16_tflops", float, "peak dense bf16 TFLOP/s per GPU"),
    ("--fp8-tflops", "fp8_tflops", float, "peak dense fp8 TFLOP/s per GPU"),
    ("--hbm-tbps", "hbm_tbps", float, "HBM bandwidth, TB/s"),
    ("--nvlink-gbps", "nvlink_gbps", float, "NVLink GB/s per GPU per direction"),
    ("--ib-gbps", "ib_gbps", float, "inter-node GB/s per GPU per direction"),
    ("--pcie-gbps", "pcie_gbps", float, "host <-> GPU GB/s per GPU"),
    ("--mfu", "mfu", float, "fraction of peak FLOP/s the learner reaches"),
    ("--bandwidth-efficiency", "bandwidth_efficiency", float, "fraction of nominal bandwidth reached"),
    ("--storage-gbps", "storage_gbps", float, "checkpoint writes per node to the shared file system, GB/s"),
    ("--host-copy-gbps", "host_copy_gbps", float, "a save's device-to-host copy per GPU, GB/s"),
    ("--hash-gbps", "hash_gbps", float, "SHA-256 of the checkpoint's files per process, GB/s"),
    ("--reserve-gib", "reserve_gib", float, "per GPU: CUDA context, NCCL buffers, fragmentation"),
    ("--vllm-workspace-gib", "vllm_workspace_gib", float, "per GPU inside vLLM's budget beside weights and KV"),
)


def parser() -> argparse.ArgumentParser:
    defaults = Hardware(gpus=1)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML recipe")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--gpus", type=int, help="world size (default: the smallest the layout allows)")
    ap.add_argument("--prompt-tokens", type=int, default=1024,
                    help="prompt length planned for (default 1024, capped by max_position_embeddings)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    ap.add_argument("--no-suggest", action="store_true", help="skip re-planning changes when it does not fit")
    for flag, name, typ, text in _HW_FLAGS:
        ap.add_argument(flag, dest=name, type=typ, default=getattr(defaults, name),
                        help=f"{text} (default {getattr(defaults, name)})")
    return ap


def default_gpus(parallel: ParallelConfig, sampler: SamplerConfig) -> int:
    """The smallest world the layout allows (TP*PP, ETP*EP*PP and rollout TP all divide it)."""
    p = parallel
    pp = p.pipeline_model_parallel_size
    rtp = sampler.tensor_parallel_size
    return math.lcm(p.tensor_model_parallel_size * pp, p.expert_tensor_parallel_size * p.expert_model_parallel_size * pp, rtp)


def run(args: argparse.Namespace) -> str:
    """The report (text or JSON) for parsed arguments; raises ConfigError for bad input."""
    from moe_rl.plan.planner import check_world, make_plan, resolve_model
    from moe_rl.plan.workload import prompt_tokens_for

    source = resolve_model(load_recipe(args.config, args.overrides)[0])  # validates after config.json
    cfg = source.cfg
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    hw = Hardware(gpus=args.gpus or default_gpus(cfg.parallel, cfg.sampler),
                  **{name: getattr(args, name) for _, name, _, _ in _HW_FLAGS})
    prompt_tokens = prompt_tokens_for(cfg.model, cfg.sampler, args.prompt_tokens)
    check_world(cfg, hw.gpus)  # before megatron is imported (make_plan's first build): a quick error
    plan = make_plan(source, hw, prompt_tokens=prompt_tokens)
    from moe_rl.plan.lora_saving import lora_saving, saving_dict, saving_lines
    from moe_rl.plan.report import plan_dict, plan_text
    from moe_rl.plan.verdict import suggest

    suggestions = [] if args.no_suggest else suggest(plan)
    saving = lora_saving(plan)  # (None without LoRA)
    if args.json:
        extra = {"lora_saving": saving_dict(saving)} if saving else {}
        return json.dumps({**plan_dict(plan, suggestions), **extra}, indent=1, default=str)
    return plan_text(plan, suggestions, args.config) + ("\n\n" + "\n".join(saving_lines(saving)) if saving else "")


def main(argv: list[str] | None = None) -> int:
    cpu_environment()
    logging.getLogger("megatron").setLevel(logging.ERROR)  # one "initialized" line per rank built
    args = parser().parse_intermixed_args(argv)  # overrides may sit between the flags
    try:
        out = run(args)
    except ConfigError as e:
        print(f"{PROG}: config error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
