"""Keep an in-process vLLM engine and the trainer in separate torch.distributed worlds.

vLLM's worker calls `torch.distributed.init_process_group` unless a default group already
exists, and then treats that group as its own world. Inside a torchrun rank the existing
group is the trainer's: vLLM would run its start-up collectives over the trainer's ranks
and deadlock (the other ranks are not constructing a sampler). On shutdown it calls
`destroy_process_group()`, which tears down *every* group of the process, megatron's
included.

`moe_rl.runtime.worlds.SeparateWorlds` keeps two snapshots of c10d's global registry (default group, group
maps, naming counter) and swaps them in and out around every call into vLLM, so vLLM only
ever sees (and creates, and destroys) its own single-rank world, and the trainer only
ever sees its own. The swap is a handful of attribute assignments; there are no
collectives. Not thread-safe: call vLLM from one thread, as the trainer does anyway.

vLLM's groups are named from 2**20 up so that their names in torch's
C++ group registry (shared by both worlds) cannot collide with the trainer's "0", "1", ...
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from moe_rl.runtime.worlds import SeparateWorlds

ENGINE_WORLD = SeparateWorlds()


@contextlib.contextmanager
def preserved_torch_state() -> Iterator[None]:
    """Undo what vLLM changes process-wide in torch while the body runs.

    vLLM's CPU worker replaces `torch.set_num_threads` with a stub that only warns; the
    engine seeds the global RNGs (python, numpy, torch) at start-up, and its CPU sampler
    draws from torch's global generator every step. The trainer keeps its own thread count
    and RNG streams (CPU ones; on GPU vLLM's seeded requests use their own generators).
    """
    set_num_threads = torch.set_num_threads
    num_threads = torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
