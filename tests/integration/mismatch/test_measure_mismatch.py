"""tools/measure_mismatch.py and moe_rl.mismatch (the measuring application) on the shipped tiny model.

Engines: the transformers sampler (starts in a second; returns routed experts), vLLM for
one fp32 check, and the learner in this process or under torchrun (EP=2).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from moe_rl.mismatch import run as run_module
from moe_rl.mismatch.run import MeasureConfig, measure, run
from moe_rl.mismatch.settings import MeasureError, ScoringLayout, Setting
from moe_rl.mismatch.sources import read_prompt_file
from moe_rl_testing import ROOT


def _load_tool():
    """tools/ is not a package: load the CLI module from its file."""
    path = ROOT / "tools" / "measure_mismatch.py"
    spec = importlib.util.spec_from_file_location("measure_mismatch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


measure_mismatch = _load_tool()

FRACTIONS = ("frac_tis_capped", "frac_outside_icepop", "frac_dlogp_gt_ln2")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- parsing (no engines)


def test_setting_grammar():
    s = Setting.parse("vllm:bf16/learner:fp32@ep2")
    assert (s.backend, s.sampler_precision, s.learner_precision, s.layout) == ("vllm", "bf16", "fp32", ScoringLayout(ep=2))
    assert s.name == "vllm:bf16/learner:fp32@ep2"
    assert Setting.parse("transformers:fp8_emulated").name == "transformers:fp8_emulated/learner:fp32"
    assert Setting.parse("vllm:fp32", ScoringLayout(tp=2, ep=2)).name == "vllm:fp32/learner:fp32@tp2-ep2"
    assert ScoringLayout.parse("tp2-ep2").nproc == 2 and ScoringLayout.parse("pp2-ep2").nproc == 4
    for bad in ("vllm", "vllm:fp16", "sglang:fp32", "vllm:fp32/learner:fp8_emulated", "vllm:fp32/ref:fp32",
                "vllm:fp32@ep", "vllm:fp32@ep2-ep2", "vllm:fp32@dp2"):
        with pytest.raises(MeasureError):
            Setting.parse(bad)
    assert Setting("vllm", "fp32", top_p=0.9).name == "vllm:fp32(top_p=0.9)/learner:fp32"
    assert measure_mismatch.parse_top_p("1,0.9,1") == [1.0, 0.9]
    for bad in ("0", "1.5", "x", ""):
        with pytest.raises(MeasureError, match="--top-p"):
            measure_mismatch.parse_top_p(bad)


def test_prompt_file_strict(tmp_path):
    ok = _write(tmp_path / "ok.jsonl", '\ufeff{"prompt": "rev 123 ="}\n\n{"prompt": "rev 45 =", "answer": "54"}\n')
    assert [p.text for p in read_prompt_file(ok)] == ["rev 123 =", "rev 45 ="]
    cases = {
        '{"prompt": "a"}\n{"question": "b"}\n': ":2: no \"prompt\" key",
        '{"prompt": "a"}\n{"prompt": "a"\n': ":2: invalid JSON",
        '["prompt"]\n': ":1: expected a JSON object",
        '{"prompt": ""}\n': ":1: \"prompt\" must be a non-empty string",
        '{"prompt": 3}\n': ":1: \"prompt\" must be a non-empty string",
    }
    for i, (text, why) in enumerate(cases.items()):
        f = _write(tmp_path / f"bad{i}.jsonl", text)
        with pytest.raises(MeasureError, match=f"{f}{why}"):
            read_prompt_file(f)


# --------------------------------------------------------------------------- bad input -> exit 2, nothing written


@pytest.mark.parametrize("case", ["missing_checkpoint", "empty_prompts", "line_without_prompt", "bad_layout"])
def test_bad_input_is_a_clear_error_and_writes_nothing(case, tmp_path, capsys):
    out = tmp_path / "report"
    args = ["--out", str(out), "--no-progress", "--backend", "transformers"]
    expect: list[str]
    if case == "missing_checkpoint":
        args += ["--checkpoint", str(tmp_path / "nope")]
        expect = [f"checkpoint {tmp_path / 'nope'} does not exist"]
    elif case == "empty_prompts":
        f = _write(tmp_path / "empty.jsonl", "\n  \n")
        args += ["--prompts", str(f)]
        expect = [f"prompt file {f} is empty"]
    elif case == "line_without_prompt":
        f = _write(tmp_path / "p.jsonl", '{"prompt": "rev 12 ="}\n{"question": "rev 3 ="}\n')
        args += ["--prompts", str(f)]
        expect = [f"{f}:2:", "prompt"]
    else:
        args += ["--layout", "ep3"]  # 8 experts do not split over 3 ranks
        expect = ["num_experts=8", "expert_model_parallel_size=3"]
    assert measure_mismatch.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("measure_mismatch: error: ")
    for e in expect:
        assert e in err, err
    assert list(tmp_path.glob("report*")) == [] and list(tmp_path.glob(".report*")) == []


def test_failure_mid_run_leaves_an_older_report_untouched(tmp_path, monkeypatch):
    out = tmp_path / "report"
    out.mkdir()
    _write(out / "mismatch.json", "old")

    def broken(*args, **kwargs):
        raise RuntimeError("sampler died")

    monkeypatch.setattr(run_module, "sample_all", broken)
    with pytest.raises(RuntimeError, match="sampler died"):
        run(MeasureConfig(settings=(Setting("transformers", "fp32"),), num_prompts=2, progress=False), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    assert [p.name for p in out.iterdir()] == ["mismatch.json"] and (out / "mismatch.json").read_text() == "old"


def test_refuses_to_replace_a_directory_that_is_not_a_report(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MeasureError, match="other than a mismatch report"):
        run(MeasureConfig(num_prompts=2, progress=False), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def precision_sweep():
    """transformers sampler in fp32 / bf16 / fp8_emulated against the fp32 learner."""
    settings = tuple(Setting("transformers", p) for p in ("fp32", "bf16", "fp8_emulated"))
    results, meta = measure(MeasureConfig(settings=settings, num_prompts=16, samples_per_prompt=4, progress=False))
    return results, meta


def test_same_weights_fp32_transformers_matches_learner(precision_sweep):
    r = precision_sweep[0]["transformers:fp32/learner:fp32"]
    s = r.summary()
    assert s["mismatch/num_tokens"] > 300
    assert float(r.tokens.valid("log_ratio").abs().max()) <= 1e-5
    for f in FRACTIONS:
        assert s[f"mismatch/{f}"] == 0
    assert s["mismatch/routing_disagree_any"] == 0  # also checks the routing alignment


def test_mismatch_grows_as_sampler_precision_drops(precision_sweep):
    results, meta = precision_sweep
    for metric in ("k3", "dp_max"):
        fp32, bf16, fp8 = (results[f"transformers:{p}/learner:fp32"].summary()[f"mismatch/{metric}"]
                           for p in ("fp32", "bf16", "fp8_emulated"))
        assert fp8 > bf16 > fp32, (metric, fp8, bf16, fp32)
    assert "EMULATION" in meta["fp8_emulated"]


@pytest.mark.vllm
def test_same_weights_fp32_vllm_matches_learner():
    """At top_p=1 the engine and the learner agree to rounding; at top_p=0.9 (one engine, a
    second generate) the sampler's processed log-prob is the nucleus's renormalized one, so
    d = learner - sampler = log(nucleus mass) <= 0 on every token: the bias RL refuses."""
    pytest.importorskip("vllm")
    settings = (Setting("vllm", "fp32"), Setting("vllm", "fp32", top_p=0.9))
    results, meta = measure(MeasureConfig(settings=settings, num_prompts=8, samples_per_prompt=2, progress=False))
    r = results["vllm:fp32/learner:fp32"]
    assert float(r.tokens.valid("log_ratio").abs().max()) <= 1e-5
    assert all(r.summary()[f"mismatch/{f}"] == 0 for f in FRACTIONS)
    assert r.summary()["mismatch/ess_token"] == pytest.approx(1.0, abs=1e-9)
    d = results["vllm:fp32(top_p=0.9)/learner:fp32"].tokens.valid("log_ratio")
    assert float(d.max()) <= 1e-5 and float(d.min()) < -0.01 and float(d.mean()) < 0
    assert meta["top_p"] == "1, 0.9"


@pytest.mark.multiproc
def test_cli_sweep_with_learner_at_ep2(tmp_path, capsys):
    """The whole tool: --sweep at one process and at EP=2 (torchrun workers), one report."""
    out = tmp_path / "mm"
    rc = measure_mismatch.main(["--backend", "transformers", "--sweep", "--layout", "1,ep2", "--num-prompts", "4",
                                "-n", "2", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "mismatch.json").read_text())
    names = list(doc["settings"])
    assert names == [f"transformers:{p}/learner:fp32{at}" for at in ("", "@ep2") for p in ("fp32", "bf16", "fp8_emulated")]
    for name in names[:3]:  # the same rollouts scored at both layouts: the same numbers
        one, ep2 = doc["settings"][name]["summary"], doc["settings"][f"{name}@ep2"]["summary"]
        assert one.keys() == ep2.keys()
        for k in one:
            assert math.isclose(one[k], ep2[k], rel_tol=1e-4, abs_tol=1e-6), (name, k, one[k], ep2[k])
    # learner vs learner on the same tokens: EP=2 changes nothing beyond rounding
    agree = doc["meta"]["learner_layouts_max_abs_dlogp"].split("; ")
    assert len(agree) == 3 and all(float(a.rsplit(": ", 1)[1]) <= 1e-5 for a in agree), agree
    report = (out / "REPORT.md").read_text()
    assert "transformers:fp8_emulated/learner:fp32@ep2" in report and "EMULATION" in report
    assert "| chi2 token | chi2 seq | ESS token |" in report
    for png in ("log_ratio_hist", "prob_scatter", "dp_max_vs_length", "mismatch_by_position", "routing_disagreement"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 1000
