"""On a CUDA GPU: the waits for the device inside the learner's micro-batches, as torch's sync
debug mode sees them (the real-GPU check of bench_host_overhead's CPU count).

    torchrun --standalone --nproc-per-node 1 -m bench.device.gpu_sync_check OUT.json [--quick]

The same steps as bench_host_overhead (score, then one update, per routing setting, after a
warm-up step), with `torch.cuda.set_sync_debug_mode("warn")` on inside megatron's
`forward_step` and `backward_step` only; each warning is charged to the innermost Python
frame outside torch (a wait in the backward shows where its forward op was made only for
custom autograd functions: the engine raises the rest where `backward` was called).
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from moe_rl_testing.op_counter import CPU_ONLY_AREAS, _short, _skipped, classify


def _innermost() -> tuple[str, int]:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not _skipped(frame.filename) and not frame.filename.endswith("gpu_sync_check.py"):
            return frame.filename, frame.lineno or 0
    return "<none>", 0


def _watch_micro_batches(seen: Counter, where: dict[str, str]) -> None:
    """Sync debug mode inside each micro-batch; every sync warning counted by its frame."""
    import megatron.core.pipeline_parallel.schedules as schedules

    def in_micro_batch(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.set_sync_debug_mode(1)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return wrapped

    schedules.forward_step = in_micro_batch(schedules.forward_step)
    schedules.backward_step = in_micro_batch(schedules.backward_step)

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return
        path, line_no = _innermost()
        owner, area = classify(path)
        seen[(where["now"], f"{owner}/{area}", f"{_short(path)}:{line_no}")] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")


def _without_apex_kernels() -> None:
    """The local layer spec (a machine without Transformer Engine) asks for apex's fused
    softmax on a GPU; without apex, torch's softmax (megatron's own fallback)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    FusedScaleMaskSoftmax.is_kernel_available = lambda self, *args, **kwargs: False


def main() -> None:
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, init_distributed, parallel_layout
    from moe_rl_testing import host_overhead as bench

    out, quick = sys.argv[1], "--quick" in sys.argv
    init_distributed()
    _without_apex_kernels()
    seen: Counter = Counter()
    where = {"now": "build"}
    _watch_micro_batches(seen, where)
    shape = bench.QUICK if quick else bench.FULL
    base = bench.model_overrides(shape)
    with parallel_layout(load_config(None, base).parallel, seed=0) as layout:
        torch.manual_seed(0)
        cfg0 = load_config(None, base)
        learner = Learner(cfg0.model, cfg0.parallel, layout, optimizer=cfg0.optimizer, total_updates=100)
        batch = bench.step_batch(shape, len(learner.taps.layers))
        for name, overrides in bench.SETTINGS.items():
            cfg = load_config(None, base + overrides)
            where["now"] = f"{name} (warm-up)"
            bench.run_step(learner, cfg, batch, counted=False)
            where["now"] = name
            bench.run_step(learner, cfg, batch, counted=False)
    rows = [{"setting": s, "who": w, "where": at, "count": n} for (s, w, at), n in sorted(seen.items())]
    project = {name: sum(r["count"] for r in rows if r["setting"] == name and r["who"].startswith("project/")
                         and r["who"].removeprefix("project/") not in CPU_ONLY_AREAS)
               for name in bench.SETTINGS}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape,
              "project_waits_in_micro_batches": project, "waits": rows}
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(project))


if __name__ == "__main__":
    main()
