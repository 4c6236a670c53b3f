"""DPO (issue 25): the sigmoid / IPO losses and gradients against closed forms, the learner's
surrogate against autograd of the direct loss, preference rows (one-line errors with line
numbers), the shipped preference files, and whole runs: held-out accuracy rises, a resumed
run is bit-exact, and a Hugging Face Qwen3-MoE directory is trained and exported back."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, load_config, to_dict
from moe_rl.programs.dpo.loss import PairLogps, margin_grad, pair_losses, pair_metrics
from moe_rl.programs.dpo.surrogate import COEF_KEY, surrogate_coefficients, surrogate_loss
from moe_rl.programs.preference.data import encode_pairs, load_pairs, pair_rows, pairs_of_step
from moe_rl.tasks.dataset import DatasetError
from moe_rl_testing import ROOT, forked

RECIPE = ROOT / "examples" / "tiny_dpo.yaml"


# --------------------------------------------------------------------------- losses


def _closed_form(h: float, beta: float, loss: str, eps: float) -> tuple[float, float]:
    """(L, dL/dh) written out with math, independently of moe_rl.programs.dpo.loss."""
    if loss == "ipo":
        return (h - 1 / (2 * beta)) ** 2, 2 * (h - 1 / (2 * beta))
    sig = 1 / (1 + math.exp(-beta * h))
    value = -(1 - eps) * math.log(sig) - eps * math.log(1 - sig)
    return value, -(1 - eps) * beta * (1 - sig) + eps * beta * sig


@pytest.mark.parametrize("loss,beta,eps", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                           ("ipo", 2.0, 0.0)])
def test_pair_losses_and_gradients_match_closed_forms(loss, beta, eps):
    g = torch.Generator().manual_seed(3)
    logps = [(torch.randn(16, generator=g, dtype=torch.float64) * 8 - 20).requires_grad_() for _ in range(4)]
    pairs = PairLogps(*logps)
    h = pairs.margin()
    pair_losses(h, beta, loss, eps).mean().backward()
    for p in range(16):
        hp = float(logps[0][p] - logps[2][p] - logps[1][p] + logps[3][p])
        want, dh = _closed_form(hp, beta, loss, eps)
        assert float(pair_losses(h[p:p + 1], beta, loss, eps)) == pytest.approx(want, abs=1e-6)
        assert float(margin_grad(h[p:p + 1].detach(), beta, loss, eps)) == pytest.approx(dh, abs=1e-6)
        # chosen, rejected, ref chosen, ref rejected: dh/d = +1, -1, -1, +1; the mean over 16 pairs
        for logp, sign in zip(logps, (1, -1, -1, 1)):
            assert float(logp.grad[p]) == pytest.approx(sign * dh / 16, abs=1e-6)


def test_trl_statistics():
    pairs = PairLogps(torch.tensor([-1.0, -5.0]), torch.tensor([-3.0, -4.0]), torch.tensor([-2.0, -4.0]),
                      torch.tensor([-2.0, -4.0]))
    m = pair_metrics(pairs, beta=0.5, loss="sigmoid")
    assert m["rewards/chosen"] == pytest.approx((0.5 * 1 + 0.5 * -1) / 2)
    assert m["rewards/rejected"] == pytest.approx((0.5 * -1 + 0.0) / 2)
    assert m["rewards/accuracies"] == 0.5 and m["rewards/margins"] == pytest.approx((1.0 + -0.5) / 2)
    assert m["logps/chosen"] == -3.0 and m["logps/rejected"] == -3.5
    assert m["loss"] == pytest.approx((-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(0.5)))) / 2)


# --------------------------------------------------------------------------- the learner's surrogate


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_surrogate_gradient_is_the_dpo_gradient(megatron_world, loss):
    """Pairs split over micro-batches of one row: the surrogate's gradient equals autograd of
    the mean pair loss computed from a plain differentiable forward of the whole batch (to
    1e-6 of the largest gradient entry: fp32 sums in another order)."""
    from moe_rl.batch import TokenBatch
    from moe_rl.learner import parallel_layout
    from moe_rl_testing.learner_utils import learner_of
    from tests.unit.learner.test_learner import main_grads, plain_logprobs

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 5, 2)]
    responses = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 2, 6, 3, 5, 1)]
    tokens = TokenBatch.from_lists(prompts + prompts, responses)
    ref_B = torch.randn(6, generator=g, dtype=torch.float64) - 20
    cfg = load_config(None, ["parallel.micro_batch_size=1"])
    with parallel_layout(cfg.parallel, seed=5) as layout:
        torch.manual_seed(5)
        learner = learner_of(cfg, layout)
        seq = (learner.logprobs(tokens).double() * tokens.response_mask()).sum(-1)
        h = PairLogps(*pair_rows(seq), *pair_rows(ref_B)).margin()
        learner.forward_backward(tokens, surrogate_loss,
                                 extras={COEF_KEY: surrogate_coefficients(h, 0.3, loss)})
        got = main_grads(learner)
        learner.model.zero_grad_buffer()
        plain = (plain_logprobs(learner, tokens) * tokens.response_mask()).sum(-1).double()
        pair_losses(PairLogps(*pair_rows(plain), *pair_rows(ref_B)).margin(), 0.3, loss).mean().backward()
        want = main_grads(learner)
    scale = max(float(t.abs().max()) for t in want.values())
    worst = max(float((got[n] - want[n]).abs().max()) for n in got)
    assert worst <= 1e-6 * scale and scale > 1e-4


# --------------------------------------------------------------------------- rows and batches


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"prompt": "rev 123 =", "chosen": " 321", "rejected": " 123"}


@pytest.mark.parametrize("bad,needles", [
    ({"prompt": "rev 1 =", "chosen": " 1"}, ["'rejected'", "no"]),
    ({"prompt": "rev 1 =", "chosen": "  ", "rejected": " 2"}, ["'chosen'", "empty"]),
    ({"prompt": "rev 1 =", "chosen": " 1", "rejected": " 1"}, ["same text"]),
    ({"prompt": "rev 1 =", "chosen": [{"role": "user", "content": "x"}], "rejected": " 2"}, ["assistant"]),
    ({"chosen": " 1", "rejected": " 2"}, ["'prompt'"]),
    ("{not json", ["invalid JSON"]),
])
def test_bad_rows_are_one_line_errors_with_line_numbers(tmp_path, bad, needles):
    path = _write(tmp_path / "p.jsonl", [GOOD, bad])
    with pytest.raises(DatasetError) as e:
        load_pairs(path)
    msg = str(e.value)
    assert "\n" not in msg and f"{path} line 2" in msg
    for needle in needles:
        assert needle in msg


def test_chosen_and_rejected_as_assistant_messages(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
           "rejected": {"role": "assistant", "content": "b"}}
    (pair,) = load_pairs(_write(tmp_path / "p.jsonl", [row]))
    assert (pair.chosen, pair.rejected, pair.problem.messages) == ("a", "b", ({"role": "user", "content": "hi"},))


def test_parquet_rows_read_like_jsonl_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD, {"prompt": "rev 45 =", "chosen": " 54", "rejected": ""}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "good.parquet")
    (pair,) = load_pairs(tmp_path / "good.parquet")
    assert (pair.problem.prompt, pair.chosen, pair.rejected) == ("rev 123 =", " 321", " 123")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad.parquet row 1: 'rejected' is empty"):
        load_pairs(tmp_path / "bad.parquet")


def test_pairs_encode_chosen_rows_then_rejected_rows_after_the_prompt_ids():
    from moe_rl.tasks.tokenizer import load_sentencepiece
    from moe_rl.tokenization import PromptEncoder

    tok = load_sentencepiece()
    encoder = PromptEncoder.from_config(load_config(None).task, tok)
    pairs = load_pairs(ROOT / "moe_rl" / "assets" / "preferences" / "reverse_prefs_eval.jsonl")[:3]
    batch = encode_pairs(pairs, encoder)
    for i, p in enumerate(pairs):
        prompt = encoder.encode(p.problem)
        for row, text in ((i, p.chosen), (i + 3, p.rejected)):
            ids = batch.tokens_BS[row, : int(batch.total_lens_B[row])].tolist()
            assert ids == prompt + tok.encode(text) + [tok.eos_id]
            assert int(batch.prompt_lens_B[row]) == len(prompt)


def test_each_pair_once_per_epoch_as_a_function_of_the_step(tmp_path):
    pairs = load_pairs(_write(tmp_path / "p.jsonl", [{**GOOD, "chosen": f" {i}"} for i in range(10)]))
    epoch = [p.chosen for s in range(5) for p in pairs_of_step(pairs, s, 2, seed=7)]
    assert sorted(epoch) == sorted(p.chosen for p in pairs) and epoch != [p.chosen for p in pairs]
    assert pairs_of_step(pairs, 3, 2, seed=7) == pairs_of_step(pairs, 3, 2, seed=7)
    assert [p.chosen for p in pairs_of_step(pairs, 1, 3, seed=7, shuffle=False)] == [" 3", " 4", " 5"]


def test_shipped_preference_files_are_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_preference_data", ROOT / "tools" / "make_preference_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--out", str(tmp_path)]) == 0
    for split in ("train", "eval"):
        name = f"reverse_prefs_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == (ROOT / "moe_rl" / "assets" / "preferences" / name).read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "reverse_prefs_train.jsonl").open()]
    assert all(r["chosen"] == " " + r["prompt"].split()[1][::-1] != r["rejected"] for r in rows)


def test_config_errors():
    for override, needle in (("dpo.beta=0", "dpo.beta"), ("dpo.label_smoothing=0.5", "dpo.label_smoothing"),
                             ("dpo.loss=hinge", "dpo.loss")):
        with pytest.raises(ConfigError, match=needle):
            load_config(RECIPE, [override])
    with pytest.raises(ConfigError, match="sigmoid only"):
        load_config(RECIPE, ["dpo.loss=ipo", "dpo.label_smoothing=0.1"])


def test_bad_row_is_one_line_from_the_command_line(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [GOOD, GOOD, {**GOOD, "rejected": GOOD["chosen"]}])
    proc = subprocess.run([sys.executable, "-m", "moe_rl.dpo", "--config", str(RECIPE), f"task.data_path={bad}",
                           f"run.output_dir={tmp_path / 'runs'}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad} line 3" in lines[0] and "same text" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- whole runs


def _fit(overrides: list[str], recipe: Path | None = RECIPE):
    from moe_rl.cli import load_resolved
    from moe_rl.loop import RunLoop
    from moe_rl.programs.dpo.program import DPOProgram

    cfg = load_resolved(recipe, overrides)
    program = DPOProgram.build(cfg)
    RunLoop(program, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()
    return program


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


def test_eval_every_zero_evaluates_nothing(megatron_world, tmp_path):
    """run.eval_every=0 means no held-out evaluation, the start's included (summary.json
    used to report the untrained policy's 0.0 as the final accuracy)."""
    _fit([f"run.output_dir={tmp_path}", "run.name=quiet", "run.steps=1", "dpo.batch_size=4", "run.eval_every=0",
          "run.export_hf=false", "logging.progress=false"])
    summary = json.loads((tmp_path / "quiet" / "summary.json").read_text())
    assert summary["eval_accuracy"] == [] and summary["final_eval_accuracy"] is None
    assert [sorted(k for k in r if k.startswith("eval/")) for r in _rows(tmp_path / "quiet").values()] == [[]]


@pytest.mark.slow
def test_run_learns_and_resumes_bit_exactly(megatron_world, tmp_path):
    """A run of 2 steps resumed to 4 equals a 4-step run (a constant lr: under the recipe's
    cosine decay the resume would keep the 2-step schedule it saved; the Ctrl-C test keeps
    run.steps)."""
    base = [f"run.output_dir={tmp_path}", "dpo.batch_size=8", "run.eval_every=2", "dpo.eval_max_pairs=32",
            "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant", "run.export_hf=false", "logging.progress=false", "run.save_every=2"]
    whole = _fit([*base, "run.name=whole", "run.steps=4"])
    _fit([*base, "run.name=resumed", "run.steps=2"])
    resumed = _fit([*base, "run.name=resumed", "run.steps=4", "run.resume=true"])
    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        assert {k: v for k, v in a[step].items() if not k.startswith("time/")} == \
               {k: v for k, v in b[step].items() if not k.startswith("time/")}
    sa, sb = whole.model.gpt.state_dict(), resumed.model.gpt.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    assert a[0]["eval/rewards/accuracies"] == 0.0 and a[4]["eval/rewards/accuracies"] > 0.5
    assert a[4]["eval/rewards/margins"] > a[2]["eval/rewards/margins"] > 0
    for key in ("learner/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "learner/grad_norm", "eval/loss"):
        assert key in a[4], key
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["final_eval_accuracy"] == a[4]["eval/rewards/accuracies"]


@pytest.mark.slow
def test_dpo_on_a_hugging_face_qwen3_moe_directory_exports_back(megatron_world, tmp_path):
    """Chat rows through the directory's own tokenizer and template; the export keeps its
    files and transformers loads it, with weights that moved from the start."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_rl_testing.hf_fixtures import CHATML, make_hf_model_dir

    src = make_hf_model_dir(tmp_path / "hf_src")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "chosen": [{"role": "assistant", "content": f"{2 * i}"}], "rejected": f"{2 * i + 1}"} for i in range(8)]
    data = _write(tmp_path / "prefs.jsonl", rows)
    trainer = _fit([f"run.init_checkpoint={src}", f"task.data_path={data}", f"task.eval_data_path={data}",
                    f"run.output_dir={tmp_path}", "run.name=hf_dpo", "run.steps=2", "dpo.batch_size=4",
                    "run.eval_every=2", "optimizer.lr=1e-3", "logging.progress=false"], recipe=None)
    out = tmp_path / "hf_dpo" / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHATML
    before = AutoModelForCausalLM.from_pretrained(str(src)).state_dict()
    after = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert type(AutoModelForCausalLM.from_pretrained(str(out))).__name__ == "Qwen3MoeForCausalLM"
    assert sorted(before) == sorted(after) and any(not torch.equal(before[k], after[k]) for k in before)
    prompt = trainer.encoder.encode(trainer.train_pairs[0].problem)
    templated = AutoTokenizer.from_pretrained(str(src)).apply_chat_template(rows[0]["messages"],
                                                                          add_generation_prompt=True, tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert prompt == templated


@pytest.mark.slow
@pytest.mark.multiproc
def test_dpo_logprobs_and_update_match_one_process_at_tp2_ep2_pp2(tmp_path):
    """The pairs' token and sequence log-probs, the DPO statistics and one surrogate update at TP2,
    EP2 (data parallel 2: a pair's chosen and rejected rows on different ranks) and PP2
    equal the 1-process run's (moe_rl_testing/workers/dpo_layouts.py)."""
    from moe_rl_testing.dist_helpers import torchrun

    torchrun("dpo_layouts.py", 2, str(tmp_path))  # (the one-process reference on rank 0 first)
    ref = torch.load(tmp_path / "reference.pt")["reference"]
    for name, lay in torch.load(tmp_path / "layouts.pt").items():
        assert (lay["logp"] - ref["logp"]).abs().max() <= 1e-6, name  # per token
        assert ((lay["seq"] - ref["seq"]).abs() / ref["seq"].abs()).max() <= 1e-7, name  # fp32 sums of ~-30
        for key, value in ref["metrics"].items():
            assert lay["metrics"][key] == pytest.approx(value, abs=1e-6), (name, key)
        assert lay["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        worst = max(float((lay["params"][k] - ref["params"][k]).abs().max()) for k in ref["params"])
        assert worst <= 1e-5, (name, worst)
        assert (lay["seq_after"] - ref["seq_after"]).abs().max() <= 1e-4, name
    assert (ref["seq_after"] - ref["seq"]).abs().max() > 1e-2  # the update moved the log-probs


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_continues_the_same_run(tmp_path):
    """SIGINT to `python -m moe_rl.dpo` after a logged step: the step finishes, a checkpoint
    is written, exit 130; `run.resume=true` then logs exactly the uninterrupted run's rows."""
    import os
    import re
    import signal
    import time

    small = ["dpo.batch_size=8", "run.eval_every=2", "dpo.eval_max_pairs=16", "optimizer.lr_warmup_steps=0",
             "run.export_hf=false", "logging.progress=false", "logging.tensorboard=false", "run.steps=5",
             f"run.output_dir={tmp_path}"]
    cmd = [sys.executable, "-m", "moe_rl.dpo", "--config", str(RECIPE), *small]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = forked.run([*cmd, "run.name=ref"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    proc = forked.popen([*cmd, "run.name=cut"], cwd=ROOT, env=env, stderr=tmp_path / "cut.stderr")
    metrics, t0 = tmp_path / "cut" / "metrics.jsonl", time.time()
    while proc.poll() is None and time.time() - t0 < 300:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:  # step 0's evaluation and step 1
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130
    stopped = int(re.search(r"stopped by SIGINT after step (\d+) of 5", (tmp_path / "cut.stderr").read_text()).group(1))
    assert 1 <= stopped < 5 and (tmp_path / "cut" / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()
    resumed = forked.run([*cmd, "run.name=cut", "run.resume=true"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    strip = lambda rows: {s: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
                          for s, r in rows.items()}
    assert strip(_rows(tmp_path / "cut")) == strip(_rows(tmp_path / "ref"))
