"""The RL step's throughput metrics (docs/step.md, "Throughput") from hand counts: the
learner's tokens per second per GPU and MFU, the engines' tokens per second per GPU, the
FLOP count for multi-latent attention, the GPU peak table and the progress bar's figures.
No model runs here: `tests/integration/test_demo_pin.py` checks the same keys in the demo's rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_rl.config import ModelConfig
from moe_rl.learner.microbatch import PassWork
from moe_rl.plan.flops import device_short_name, peak_bf16_flops, train_flops
from moe_rl.programs.rl.learner_role import LearnerRole
from moe_rl.programs.rl.throughput import learner_perf
from moe_rl.rollout.collector import RolloutCollector
from moe_rl.rollout.placement import EnginePlacement
from moe_rl.rollout.types import GroupSummary


def test_learner_mfu_is_the_updates_flops_over_seconds_gpus_and_peak():
    """Two updates on 2 GPUs of a 1e9 FLOP/s peak: sequences of 16 and 8 tokens (24 tokens,
    squares 256 + 64) in 0.5 s and 1.5 s. The tiny model's pass costs 3 * (24 * 413696 +
    4 layers * 2 * 4 heads * 32 * 320) = 30,769,152 FLOPs (tests/integration/bench/test_device_checks.py counts
    413696 by hand), so MFU = 30,769,152 / (2 s * 2 GPUs * 1e9) and tokens/s/GPU = 24 / 2 / 2."""
    m = ModelConfig()
    works = [PassWork(16.0, 256.0, 0.5), PassWork(8.0, 64.0, 1.5)]
    out = learner_perf(m, works, gpus=2, peak=1e9)
    assert train_flops(m, [16, 8]) == 30_769_152
    assert out == {"perf/learner_tokens": 24.0, "perf/learner_tokens_per_s_per_gpu": 6.0,
                   "perf/mfu_learner": pytest.approx(30_769_152 / 4e9, rel=1e-12)}
    assert "perf/mfu_learner" not in learner_perf(m, works, gpus=2, peak=None)  # (CPU: no MFU)
    assert learner_perf(m, [], gpus=2, peak=1e9) == {}  # (a step that does not train the actor)


def test_multi_latent_attention_flops_by_hand():
    """MLA, 2 layers (1 dense, 1 MoE), h 64, 4 heads, q latent 16, kv latent 8, qk 8 + rope 4,
    v 8; forward per token and layer: q 2*64*16 + 2*16*4*12 = 3584, kv 2*64*(8+4) + 2*8*4*(8+8)
    = 2560, out 2*4*8*64 = 4096 (10240); MoE router 2*64*8 + experts 2*3*64*64*2 = 50176; dense
    MLP 2*3*64*128 = 49152; head 2*64*128 = 16384: 136192 per token. Causal core: 2 layers *
    4 heads * (12 + 8) = 160 per squared length. A 10-token sequence: 3 * (1361920 + 16000)."""
    m = ModelConfig(multi_latent_attention=True, num_layers=2, num_dense_layers=1, ffn_hidden_size=128,
                    hidden_size=64, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                    qk_pos_emb_head_dim=4, v_head_dim=8, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64,
                    vocab_size=128)
    assert train_flops(m, [10]) == 3 * (136192 * 10 + 160 * 100) == 4_133_760


@pytest.mark.parametrize("name, tflops, short", [
    ("NVIDIA H100 80GB HBM3", 989.0, "h100"), ("NVIDIA H100 PCIe", 756.0, "h100_pcie"),
    ("NVIDIA H200", 989.0, "h200"), ("NVIDIA H20", 148.0, "h20"), ("NVIDIA A100-SXM4-80GB", 312.0, "a100"),
    ("NVIDIA A10G", None, "nvidia_a10g")])
def test_peak_table_matches_the_device_name(name, tflops, short):
    assert peak_bf16_flops(name) == (tflops * 1e12 if tflops else None)
    assert device_short_name(name) == short


def test_engine_throughput_is_every_drawn_token_over_the_slowest_engines_and_their_gpus():
    """2 engines of 2 ranks (4 GPUs), two draws (dynamic sampling): 7 + 5 + 2 + 6 = 20 response
    tokens in all, each draw waiting for its slowest engine: 2 s + 3 s."""
    self = SimpleNamespace(placement=EnginePlacement(world=4, rank=0, ranks_per_engine=2))
    drawn = [[GroupSummary(3, (4, 3), (1.0, 0.0), ("stop", "stop"))],
             [GroupSummary(3, (5,), (1.0,), ("stop",)), GroupSummary(2, (2, 6), (0.0, 1.0), ("stop", "length"))]]
    stats = RolloutCollector._engine_stats(self, [[1.0, 2.0], [3.0, 1.0]], drawn)
    assert stats == {"sampler/engines": 2.0, "sampler/sample_seconds_max": 4.0, "sampler/sample_seconds_min": 3.0,
                     "perf/engine_tokens": 20.0, "perf/engine_tokens_per_s_per_gpu": 20.0 / 5.0 / 4}


def test_progress_bar_shows_tokens_per_second_and_mfu():
    metrics = {"reward/mean": 0.5, "perf/engine_tokens_per_s_per_gpu": 1234.4,
               "perf/learner_tokens_per_s_per_gpu": 8912.6, "perf/mfu_learner": 0.0123}
    assert LearnerRole.postfix(None, metrics) == {"reward": "0.5", "gen tok/s/gpu": "1234", "train tok/s/gpu": "8913",
                                                  "mfu": "1.2%"}
