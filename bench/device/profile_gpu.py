"""Where a learner step's time goes on one GPU: torch.profiler over bf16 `train_step`s at
the Qwen3-30B-A3B layer shape (bench/device/bench_gpu.py's model and batch).

    python -m bench.device.profile_gpu [--layers 1] [--steps 2] [--spec te|local]
        # -> bench/results/gpu_<device>_profile.md (and .json)

The MFU of bench_gpu's table is far below the GEMMs' rate; this names the cause: the GPU's
busy time against the step's wall time (a step the GPU idles through is bound by the host:
launches, synchronisations, Python), the kernels that take the GPU time, and the host
operations that take the host time (a `cudaStreamSynchronize` or `aten::item` high in the
host list is a device-to-host wait), and the host ops whose kernels take the GPU time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.device import bench_gpu
from moe_rl.plan.flops import device_short_name
from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, synced, write_results

TOP = 25


def _rows(events: Any, key: str, total_us: float) -> list[list[Any]]:
    """The TOP events by `key` (self_device_time_total or self_cpu_time_total), in ms and %."""
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP]
    return [[e.key[:90].replace("|", "/"), e.count, getattr(e, key) / 1e3, f"{100 * getattr(e, key) / max(total_us, 1):.1f}%"]
            for e in ranked]


def profile(layers: int, steps: int, spec: str) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from moe_rl.config import load_config
    from moe_rl.learner import Learner, init_distributed, parallel_layout

    if not torch.cuda.is_available():
        raise SystemExit("profile_gpu needs a CUDA GPU")
    init_distributed()
    bench_gpu._LAYERS = layers
    batch, adv_B = bench_gpu.bench_batch(8, 2048, 32768)
    cfg = load_config(ROOT / "examples/tiny_rspo.yaml", bench_gpu.shape_overrides(layers, spec))
    with parallel_layout(bench_gpu._parallel(), seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=steps + 8)

        def step() -> None:
            synced(learner.train_step, batch, bench_gpu.reinforce(batch), {"adv_B": adv_B})

        for _ in range(2):  # warm-up: allocator, TE's kernel selection, autotuning
            step()
        t0 = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
        wall_s = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    # A kernel's time appears twice: as the kernel's own event and as the device time of the
    # host op that launched it. The kernels alone give the GPU's busy time.
    kernels = [e for e in events if e.device_type != DeviceType.CPU]
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    device_us = sum(e.self_device_time_total for e in kernels) / steps
    host_us = sum(e.self_cpu_time_total for e in ops) / steps
    tokens = batch.batch_size * batch.seq_len
    summary = markdown_table(
        ["layers", "spec", "step wall s (profiled)", "GPU busy s / step", "GPU busy / wall", "tokens / step"],
        [[layers, spec, wall_s, device_us / 1e6, f"{100 * device_us / 1e6 / max(wall_s, 1e-9):.1f}%", tokens]])
    gpu_table = markdown_table(["kernel (GPU time)", "calls", "ms", "% of GPU"],
                               _rows(kernels, "self_device_time_total", device_us * steps))
    launch_table = markdown_table(["host op (GPU time of the kernels it launched)", "calls", "ms", "% of GPU"],
                                  _rows(ops, "self_device_time_total", device_us * steps))
    cpu_table = markdown_table(["host op (self host time)", "calls", "ms", "% of host"],
                               _rows(ops, "self_cpu_time_total", host_us * steps))
    table = summary + "\n" + gpu_table + "\n" + launch_table + "\n" + cpu_table
    print(table)
    short = device_short_name(torch.cuda.get_device_name())
    notes = (f"`python -m bench.device.profile_gpu --layers {layers} --steps {steps} --spec {spec}`: torch.profiler over "
             f"{steps} bf16 train_steps of {batch.batch_size} x {batch.seq_len} tokens after 2 warm-up steps; "
             "times are totals over the profiled steps.")
    print(write_results(f"gpu_{short}_profile", {"layers": layers, "steps": steps, "spec": spec, "wall_s": wall_s,
                                                 "gpu_busy_s": device_us / 1e6, "host_self_s": host_us / 1e6},
                        table, notes))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1, help="layers of the Qwen3-30B-A3B shape (default 1)")
    ap.add_argument("--steps", type=int, default=2, help="profiled train_steps after 2 warm-up steps (default 2)")
    ap.add_argument("--spec", choices=("te", "local"), default="te", help="layer spec (default te)")
    args = ap.parse_args()
    profile(args.layers, args.steps, args.spec)
