"""Every change moe_rl makes to megatron-core at run time, one module each, and what each
relies on upstream (its `UPSTREAM` symbols, checked by tests/unit/learner/test_megatron_patches.py, which
fails naming the symbol when a megatron-core release moves or changes it).

On the CPU (CI, laptops; `apply()` installs these, idempotent, before a model is built,
never at import time: vLLM's spawned processes re-import `__main__`):
- `cpu_torch`: every loaded megatron module's `torch` is a view whose `cuda` answers for the
  CPU and whose tensor factories map a CUDA device to the CPU;
- `rng_tracker`: the CUDA RNG tracker over CPU generator states;
- `alltoall_split_sizes`: split sizes as Python ints for gloo's all-to-all;
- `clip_grads`: clipping without the CUDA type-string assertion;
- `tied_embeddings`: tied embeddings under pipeline parallelism synced without `.cuda()`.
On any device:
- `te_general_gemm`: the router's gating linear without Transformer Engine;
- `torch_norm`: the local spec's torch norms under sequence parallel;
- `mla_te_linear`: multi-latent attention without Transformer Engine (when a model has it);
- `unfused_linears`: megatron's own linears built without apex under gradient-accumulation
  fusion (a context manager around the model's build);
- `dcp_writes`: checkpoint files written by threads of the trainer, not forked writers (a
  context manager around each save);
- `router_replay`: the routing taps' hold on each `TopKRouter.routing` and on megatron's
  `RouterReplay` (`moe_rl.learner.routing.taps`).
"""

from __future__ import annotations

import logging

import torch

from moe_rl.learner.megatron_patches import (
    alltoall_split_sizes,
    clip_grads,
    cpu_torch,
    rng_tracker,
    te_general_gemm,
    tied_embeddings,
    torch_norm,
)

log = logging.getLogger(__name__)

PATCH_MODULES = ("cpu_torch", "rng_tracker", "alltoall_split_sizes", "clip_grads", "tied_embeddings",
                 "te_general_gemm", "torch_norm", "mla_te_linear", "unfused_linears", "dcp_writes", "router_replay")
"""Every module of this folder (the guard test checks each one's `UPSTREAM`)."""

_applied = {"cpu": False}  # (megatron's modules are process-wide: so is whether they are patched)


def apply() -> bool:
    """Install the patches every device needs, and the CPU's when CUDA is absent (idempotent).
    Returns True when the CPU patches are active."""
    cpu_torch.import_megatron_modules()
    te_general_gemm.apply()
    torch_norm.apply()
    if torch.cuda.is_available():
        return False
    if _applied["cpu"]:
        return True
    n = cpu_torch.redirect_torch_in_megatron_modules()
    rng_tracker.apply()
    alltoall_split_sizes.apply()
    clip_grads.apply()
    tied_embeddings.apply()
    _applied["cpu"] = True
    log.debug("megatron-core CPU patches applied (%d modules redirected)", n)
    return True
