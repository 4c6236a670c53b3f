"""Test-wide settings: CPU-friendly environment, GPU marker skipping."""

import os
import shutil

# CPU: no torch.compile anywhere (slow to start, nothing to gain). Not on a GPU machine:
# vLLM on CUDA compiles its model, and 0.26 refuses to start with dynamo disabled
# ("aot_compile is not supported by the current configuration", H100, 2026-11-25).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world for in-process learner tests (megatron shims applied): made
    once per module (a no-op while it lives), so a module after one whose in-process run ended
    it (`moe_rl.cli` destroys the process group at a program's end) finds it again, whatever
    order the modules run in."""
    from moe_rl.learner import init_distributed

    return init_distributed()
