"""Test-wide settings: CPU-friendly environment, GPU marker skipping."""

import os

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


@pytest.fixture(scope="session")
def megatron_world():
    """A one-process gloo world for in-process learner tests (megatron shims applied)."""
    from moe_rl.learner import init_distributed

    return init_distributed()
