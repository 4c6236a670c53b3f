"""Test-wide settings: CPU-friendly environment, GPU marker skipping."""

import os
import shutil

# CPU: no torch.compile anywhere (slow to start, nothing to gain). Not on a GPU machine:
# vLLM on CUDA compiles its model, and 0.26 refuses to start with dynamo disabled
# ("aot_compile is not supported by the current configuration", H100, 2026-11-25).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on 2 cores: each (and every child it starts) on one OpenMP
    # thread, or two workers' thread pools spin against each other (~6x slower matmuls)
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    _heavy_modules_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _heavy_modules_first(items) -> None:
    """The longest modules first (their measured seconds, tests/module_seconds.json, keyed by
    file name; file order kept within a module), so that `make test`'s workers (pytest-xdist,
    one file at a time) end on short files instead of one worker finishing a long one alone.
    Modules not measured go after: multi-process ones, then the rest of tests/integration/ and
    slow ones, then the unit tests."""
    import json
    from pathlib import Path

    seconds = json.loads((Path(__file__).parent / "module_seconds.json").read_text())

    def key(item) -> tuple[int, float]:
        name = item.module.__name__.rpartition(".")[2]
        if name in seconds:
            return (0, -seconds[name])
        integration = "integration" in Path(str(item.path)).parts
        return (1, 0 if "multiproc" in item.keywords else 1 if integration or "slow" in item.keywords else 2)

    best: dict[str, tuple[int, float]] = {}
    for item in items:
        best[item.module.__name__] = min(best.get(item.module.__name__, (9, 0.0)), key(item))
    items.sort(key=lambda item: best[item.module.__name__])  # (stable: the order within a module stays)


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world for in-process learner tests (megatron shims applied): made
    once per module (a no-op while it lives), so a module after one whose in-process run ended
    it (`moe_rl.cli` destroys the process group at a program's end) finds it again, whatever
    order the modules run in."""
    from moe_rl.learner import init_distributed

    return init_distributed()
