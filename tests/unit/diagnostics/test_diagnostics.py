"""Mismatch metrics against a hand-computed example, input errors, and the report writer."""

import json
import math

import pytest
import torch

from moe_rl.diagnostics import compute_mismatch, report, write_report
from moe_rl.routing import topk_disagreement

NAN = float("nan")

# 3 sequences, T = 3; sequence 1 is padded after one token (its padding holds garbage).
# q = sampler probability, p = learner probability of each sampled token; r = p / q.
#   seq 0: (q, p) = (0.55, 0.55) r = 1    (0.8, 0.2) r = 0.25   (0.2, 0.6) r = 3
#   seq 1: (0.95, 0.95) r = 1             pad                   pad
#   seq 2: (0.4, 0.6) r = 1.5             (0.05, 0.2) r = 4     (0.995, 0.995) r = 1
# No q sits on a probability-bucket edge, no r on a threshold (0.5, 2).
Q = [[0.55, 0.8, 0.2], [0.95, NAN, NAN], [0.4, 0.05, 0.995]]
P = [[0.55, 0.2, 0.6], [0.95, 0.3, 0.3], [0.6, 0.2, 0.995]]
MASK = [[True, True, True], [True, False, False], [True, True, True]]

# d = ln r per valid token: 0, -1.386294, 1.098612 | 0 | 0.405465, 1.386294, 0
# k3 = r - 1 - ln r:        0,  0.636294, 0.901388 | 0 | 0.094535, 1.613706, 0
# |dp| = |p - q|:           0,  0.6,      0.4      | 0 | 0.2,      0.15,     0
HAND = {
    "mismatch/num_tokens": 7,
    "mismatch/num_sequences": 3,
    # per-sequence mean |dp|: 1.0/3, 0, 0.35/3 -> mean over 3 sequences = 0.15
    "mismatch/dp_mean": 0.15,
    # per-sequence max |dp|: 0.6, 0, 0.2 -> 0.8/3
    "mismatch/dp_max_mean": 0.8 / 3,
    "mismatch/dp_max": 0.6,
    # k1 = mean(-d) = -(-1.386294 + 1.098612 + 0.405465 + 1.386294) / 7 = -1.504077 / 7
    "mismatch/k1": -(math.log(0.25) + math.log(3) + math.log(1.5) + math.log(4)) / 7,
    # k3 = (0.636294 + 0.901388 + 0.094535 + 1.613706) / 7 = 3.245923 / 7 = 0.463703
    "mismatch/k3": (
        (0.25 - 1 - math.log(0.25)) + (2 - math.log(3)) + (0.5 - math.log(1.5)) + (3 - math.log(4))
    )
    / 7,
    # log ppl_learner - log ppl_sampler per sequence = mean_t(-d):
    #   seq 0: (1.386294 - 1.098612) / 3 = 0.095894; seq 1: 0; seq 2: -1.791759 / 3 = -0.597253
    #   mean = (0.095894 + 0 - 0.597253) / 3 = -0.167120
    "mismatch/log_ppl_diff": ((math.log(4) - math.log(3)) / 3 - math.log(6) / 3) / 3,
    # r > 2: {3, 4} -> 2/7; r outside [0.5, 2]: {0.25, 3, 4} -> 3/7; |d| > ln 2: same 3/7
    "mismatch/frac_tis_capped": 2 / 7,
    "mismatch/frac_outside_icepop": 3 / 7,
    "mismatch/frac_dlogp_gt_ln2": 3 / 7,
    # r = 1, 0.25, 3 | 1 | 1.5, 4, 1: sum 11.75, sum of squares 1 + 0.0625 + 9 + 1 + 2.25 + 16 + 1 = 30.3125
    "mismatch/ratio_mean": 11.75 / 7,
    "mismatch/chi2_token": 30.3125 / 7 - 1,
    "mismatch/ess_token": 11.75**2 / (7 * 30.3125),
    # sequence ratios 0.75, 1, 6: squares 0.5625, 1, 36 -> mean 37.5625 / 3, minus 1
    "mismatch/chi2_seq": 37.5625 / 3 - 1,
}


def _example(dtype=torch.float64):
    sampler = torch.tensor(Q, dtype=dtype).log()
    learner = torch.tensor(P, dtype=dtype).log()
    return sampler, learner, torch.tensor(MASK)


def _assert_close(got: float, want: float, tol: float = 1e-6) -> None:
    assert abs(got - want) <= tol, (got, want)


# --------------------------------------------------------------------------- metrics


def test_summary_matches_hand_values():
    s = compute_mismatch(*_example()).summary()
    assert set(HAND) <= set(s)
    for key, want in HAND.items():
        _assert_close(s[key], want)
    _assert_close(s["mismatch/k3"], 0.463703)
    _assert_close(s["mismatch/log_ppl_diff"], -0.167120)


def test_float32_inputs_give_the_same_summary():
    s = compute_mismatch(*_example(torch.float32)).summary()
    for key, want in HAND.items():
        _assert_close(s[key], want, 1e-5)


def test_position_buckets_hand_values():
    r = compute_mismatch(*_example(), position_edges=[0, 1, 3])
    first, rest = r.by_position.rows()
    # [0, 1): first tokens r = 1, 1, 1.5; |dp| 0, 0, 0.2 -> dp_mean 0.2/3, k3 0.094535/3
    assert first["bucket"] == "[0, 1)" and first["num_tokens"] == 3
    _assert_close(first["dp_mean"], 0.2 / 3)
    _assert_close(first["k3"], (0.5 - math.log(1.5)) / 3)
    _assert_close(first["frac_tis_capped"], 0.0)
    # [1, 3] (last bucket closed): seq0 t1, t2 and seq2 t1, t2: |dp| 0.6, 0.4, 0.15, 0
    #   dp_mean = 1.15/4 = 0.2875; per-sequence max 0.6 and 0.15 -> dp_max_mean 0.375
    #   k3 = (0.636294 + 0.901388 + 1.613706 + 0) / 4 = 0.787847; r > 2: {3, 4} -> 2/4
    #   outside band: {0.25, 3, 4} -> 3/4
    assert rest["bucket"] == "[1, 3]" and rest["num_tokens"] == 4
    _assert_close(rest["dp_mean"], 0.2875)
    _assert_close(rest["dp_max_mean"], 0.375)
    _assert_close(rest["k3"], 0.787847)
    _assert_close(rest["frac_tis_capped"], 0.5)
    _assert_close(rest["frac_outside_icepop"], 0.75)
    assert r.by_position.num_outside.item() == 0


def test_tokens_outside_user_edges_are_counted():
    # edges [0, 1]: one closed bucket holding positions 0 and 1; position 2 of seq 0 and
    # seq 2 falls outside: 5 tokens in, 2 outside
    table = compute_mismatch(*_example(), position_edges=[0, 1]).by_position
    assert table.rows()[0]["num_tokens"] == 5
    assert table.num_outside.item() == 2


def test_sampler_prob_buckets_hand_values():
    rows = compute_mismatch(*_example()).by_sampler_prob.rows()
    assert [row["bucket"] for row in rows] == [
        "[0, 0.1)",
        "[0.1, 0.5)",
        "[0.5, 0.9)",
        "[0.9, 0.99)",
        "[0.99, 1]",
    ]
    # q in buckets: 0.05 | 0.2, 0.4 | 0.55, 0.8 | 0.95 | 0.995
    assert [row["num_tokens"] for row in rows] == [1, 2, 2, 1, 1]
    # [0, 0.1): the r = 4 token: |dp| 0.15, k1 = -ln 4, capped
    _assert_close(rows[0]["dp_mean"], 0.15)
    _assert_close(rows[0]["k1"], -math.log(4))
    _assert_close(rows[0]["frac_tis_capped"], 1.0)
    # [0.1, 0.5): r = 3 (|dp| 0.4) and r = 1.5 (|dp| 0.2): dp_mean 0.3, one of two capped
    _assert_close(rows[1]["dp_mean"], 0.3)
    _assert_close(rows[1]["frac_tis_capped"], 0.5)
    # [0.5, 0.9): r = 1 and r = 0.25: k3 = 0.636294 / 2, one of two outside the band
    _assert_close(rows[2]["k3"], (0.25 - 1 - math.log(0.25)) / 2)
    _assert_close(rows[2]["frac_outside_icepop"], 0.5)
    _assert_close(rows[4]["k3"], 0.0)


def test_empty_buckets_are_nan_and_counted_zero():
    # only the first token of each sequence valid: prob buckets [0.1,0.5) and [0.5,0.9)...
    s, lp, m = _example()
    m = torch.zeros_like(m)
    m[:, 0] = True  # q = 0.55, 0.95, 0.4
    rows = compute_mismatch(s, lp, m).by_sampler_prob.rows()
    assert rows[0]["num_tokens"] == 0 and math.isnan(rows[0]["dp_mean"])


def test_no_valid_token_gives_zeros_not_nan():
    s, lp, m = _example()
    r = compute_mismatch(s, lp, torch.zeros_like(m))
    assert all(v == 0.0 for v in r.summary().values())


def test_padding_garbage_is_ignored():
    s, lp, m = _example()
    s2, l2 = s.clone(), lp.clone()
    s2[1, 1:] = float("-inf")
    l2[1, 1:] = 5.0  # not even a log-prob: masked, so never checked or used
    assert compute_mismatch(s2, l2, m).summary() == compute_mismatch(s, lp, m).summary()


def test_k3_keeps_precision_for_tiny_log_ratios():
    # d = 1e-4 in float32 inputs: k3 = exp(d) - 1 - d ~ d^2 / 2 = 5e-9
    s = torch.full((2, 64), math.log(0.3), dtype=torch.float32)
    lp = s + 1e-4
    d = (lp.double() - s.double())[0, 0].item()  # the exact float32 difference
    k3 = compute_mismatch(s, lp, torch.ones(2, 64, dtype=torch.bool)).summary()["mismatch/k3"]
    assert abs(k3 - (math.expm1(d) - d)) < 1e-3 * k3


def test_routing_disagreement_uses_routing_stats():
    torch.manual_seed(0)
    B, T, L, K = 3, 3, 4, 2
    sampler_ids = torch.stack([torch.randperm(8)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
    learner_ids = sampler_ids.flip(-1).to(torch.int16)  # same sets
    learner_ids[0, 0, 1, 0] = 9  # token (0, 0) differs in layer 1
    learner_ids[2, 1, 3, 1] = 9  # token (2, 1) differs in layer 3
    learner_ids[1, 2, 0, 0] = 9  # token (1, 2) is padding: not counted
    r = compute_mismatch(*_example(), sampler_ids_BTLK=sampler_ids, learner_ids_BTLK=learner_ids)
    s = r.summary()
    # 7 valid tokens: one differs in layer 1, one in layer 3 -> 1/7 each, any layer 2/7
    _assert_close(s["mismatch/routing_disagree_layer0"], 0.0)
    _assert_close(s["mismatch/routing_disagree_layer1"], 1 / 7)
    _assert_close(s["mismatch/routing_disagree_layer3"], 1 / 7)
    _assert_close(s["mismatch/routing_disagree_any"], 2 / 7)
    per_layer, any_ = topk_disagreement(
        sampler_ids.view(-1, L, K), learner_ids.view(-1, L, K), torch.tensor(MASK).view(-1)
    )
    torch.testing.assert_close(r.routing_disagree_per_layer, per_layer)
    torch.testing.assert_close(r.routing_disagree_any, any_)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s, lp, m: (s[0], lp, m), "sampler_logp_BT"),
        (lambda s, lp, m: (s, lp[:, :2], m), "learner_logp_BT"),
        (lambda s, lp, m: (s, lp, m.int()), "mask_BT"),
        (lambda s, lp, m: (s, lp.long(), m), "learner_logp_BT"),
    ],
)
def test_bad_shapes_and_dtypes_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        compute_mismatch(*change(*_example()))


def test_bad_values_and_options_are_clear_errors():
    s, lp, m = _example()
    l_nan = lp.clone()
    l_nan[2, 1] = NAN
    with pytest.raises(ValueError, match=r"learner_logp_BT .*\[2, 1\]"):
        compute_mismatch(s, l_nan, m)
    with pytest.raises(ValueError, match="sampler_logp_BT"):
        compute_mismatch(-s, lp, m)  # positive "log-probs"
    with pytest.raises(ValueError, match="together"):
        compute_mismatch(s, lp, m, sampler_ids_BTLK=torch.zeros(3, 3, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="learner_ids_BTLK"):
        compute_mismatch(
            s,
            lp,
            m,
            sampler_ids_BTLK=torch.zeros(3, 3, 2, 2, dtype=torch.uint8),
            learner_ids_BTLK=torch.zeros(3, 3, 2, 1, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match="position_edges"):
        compute_mismatch(s, lp, m, position_edges=[0, 4, 4])
    with pytest.raises(ValueError, match="prob_edges"):
        compute_mismatch(s, lp, m, prob_edges=[0, 0.5, 1.5])
    with pytest.raises(ValueError, match="icepop_band"):
        compute_mismatch(s, lp, m, icepop_band=(2.0, 0.5))


# --------------------------------------------------------------------------- report


def _results():
    s, lp, m = _example()
    ids = torch.tensor([[0, 1], [2, 3]]).expand(3, 3, 2, 2).clone()
    other = ids.clone()
    other[0, 1, 1] = torch.tensor([3, 5])
    return {
        "bf16": compute_mismatch(s, lp, m, sampler_ids_BTLK=ids, learner_ids_BTLK=other),
        "identical": compute_mismatch(s, s, m),
    }


def test_report_writes_files_and_json_round_trips(tmp_path):
    results = _results()
    out = write_report(tmp_path / "rep", results, {"checkpoint": "ckpt/step_10", "prompts": 3})
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"mismatch.json", "REPORT.md"} <= names
    pngs = [n for n in names if n.endswith(".png")]
    assert len(pngs) == 5  # 4 plots + routing (one setting has routing)
    for n in pngs:
        assert (out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    doc = json.loads((out / "mismatch.json").read_text())
    assert doc["meta"] == {"checkpoint": "ckpt/step_10", "prompts": 3}
    for name, r in results.items():
        assert doc["settings"][name]["summary"] == pytest.approx(r.summary())
    _assert_close(doc["settings"]["bf16"]["summary"]["mismatch/k3"], HAND["mismatch/k3"])
    assert doc["settings"]["bf16"]["routing"]["disagree_any"] == pytest.approx(1 / 7)
    rows = doc["settings"]["bf16"]["by_sampler_prob"]["rows"]
    assert [row["num_tokens"] for row in rows] == [1, 2, 2, 1, 1]

    md = (out / "REPORT.md").read_text()
    for needle in ("| bf16 |", "| identical |", "How to read this", "plots/prob_scatter.png"):
        assert needle in md
    assert "0.4637" in md  # k3 of bf16, formatted to 4 significant digits
    assert not [p for p in tmp_path.iterdir() if p.name != "rep"]  # no temp dirs left


def test_report_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(report, "plot_prob_scatter", boom)
    with pytest.raises(RuntimeError, match="plot failed"):
        write_report(tmp_path / "rep", _results(), {})
    assert list(tmp_path.iterdir()) == []


def test_report_replaces_old_report_only_on_success(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "REPORT.md").write_text("old report")
    (out / "stale.txt").write_text("from an older run")

    monkeypatch.setattr(report, "plot_dp_max_vs_length", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_report(out, _results(), {})
    assert (out / "REPORT.md").read_text() == "old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]

    monkeypatch.undo()
    write_report(out, _results(), {})
    assert (out / "REPORT.md").read_text() != "old report"
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


def test_report_bad_arguments_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="results"):
        write_report(tmp_path / "rep", {}, {})
    with pytest.raises(TypeError, match="results"):
        write_report(tmp_path / "rep", {"x": {"k3": 0.1}}, {})
    with pytest.raises(ValueError, match="meta"):
        write_report(tmp_path / "rep", _results(), {"obj": object()})
    assert list(tmp_path.iterdir()) == []


def test_number_formatting():
    assert report.fmt_num(None) == "–"
    assert report.fmt_num(NAN) == "–"
    assert report.fmt_num(0.0) == "0"
    assert report.fmt_num(7.0) == "7"
    assert report.fmt_num(3.2e-6) == "3.20e-06"
    assert report.fmt_num(0.4637032) == "0.4637"
