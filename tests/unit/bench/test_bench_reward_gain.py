"""The long-tail bench's reward comparison (bench/cpu/async_long_tail.py), on hand-made runs: the
gains are held-out rewards minus the base's, the share is the ratio of the mean gains, and the
paired difference and intervals are the t intervals of the per-seed numbers."""

from __future__ import annotations

from bench.cpu.async_long_tail import SHIPPED, reward_summary


def test_reward_summary_compares_held_out_gains_paired_by_seed():
    runs = {"synchronous": {1: {"heldout": 0.80, "train_gain": 0.10}, 2: {"heldout": 0.84, "train_gain": 0.00}},
            SHIPPED: {1: {"heldout": 0.79, "train_gain": 0.20}, 2: {"heldout": 0.83, "train_gain": 0.10},
                      3: {"heldout": 0.90, "train_gain": 0.30}}}  # (seed 3 has no synchronous run: left out)
    text = reward_summary(runs, base=0.78)
    # gains: synchronous 0.02, 0.06 (mean 0.04, sd 0.0283, t(1) = 12.71: +-0.254); in flight 0.01, 0.05
    assert "synchronous 0.040 ± 0.254, in-flight + partial 0.030 ± 0.254" in text
    assert "75% of the synchronous gain" in text  # 0.03 / 0.04
    assert "paired by seed: -0.010 ± 0.000" in text  # both seeds -0.01
    assert "1: 0.020 / 0.010, 2: 0.060 / 0.050." in text
    assert "2 seeds" in text and "(0.7800)" in text
    assert "synchronous 0.050 ± 0.635, in-flight + partial 0.150 ± 0.635" in text  # the training-reward gains
