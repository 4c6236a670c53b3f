"""The ablation driver's settings and report (the runs themselves are `make ablations`)."""

import json

import pytest

from moe_rl.ablations import report, settings, summarize
from moe_rl.config import load_config


def test_twenty_settings_all_valid():
    s = settings()
    assert len(s) == 20
    assert {"grpo-on", "grpo-r2-tis-off", "grpo-r3-on", "gspo-tis-on", "rspo-off"} <= set(s)
    for name, overrides in s.items():
        cfg = load_config("examples/ablations.yaml", overrides)
        assert cfg.rl.num_minibatches == (4 if name.endswith("-off") else 1)
        assert (cfg.rl.rollout_correction == "tis") == ("-tis" in name)


def test_summary_and_report_from_metrics(tmp_path):
    rows = [{"step": i + 1, "reward/mean": r, "policy/clip_frac": 0.1, "routing/gamma_mean": 0.9,
             "routing/gamma_min": 0.5 - 0.01 * i, "mismatch/k3": 1e-4, "time/step": 0.5}
            for i, r in enumerate([0.0, 0.2, 0.4, 0.6] * 5)]
    s = summarize("rspo-off", rows)
    # final reward: last 10 steps = 0.4, 0.6, 0.0, 0.2, 0.4, 0.6, 0.0, 0.2, 0.4, 0.6 -> 3.4 / 10
    assert s["final_reward"] == pytest.approx(0.34)
    assert s["reward_auc"] == pytest.approx(0.3)  # mean of 0, .2, .4, .6
    assert s["gamma_min"] == pytest.approx(0.31) and s["clip_frac"] == pytest.approx(0.1)
    for name in ("rspo-off", "grpo-on"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = report(tmp_path)
    text = path.read_text()
    assert "| rspo-off | 0.340 | 0.300 |" in text and "| grpo-on |" in text
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"reward.png", "flip_rate.png", "gamma.png"}
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 2
