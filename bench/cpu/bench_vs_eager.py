"""The learner's RL update against plain eager code, and the weight push against its bytes.

For the demo model (examples/tiny_rspo.yaml, the shipped tiny_base weights) and the ablation
model (examples/ablations.yaml: 8 layers, 64 experts top-16), on the demo's batch shape
(128 sequences: 12-token prompts, 4-16-token responses), interleaved in one process:

- **learner**: `Learner.update` as the RL step runs it (the recipe's policy loss, the
  on-policy shortcut's plan, routing capture where the recipe records it, clipping, Adam);
- **transformers**: the same weights in transformers' own `Qwen3MoeForCausalLM` (its
  default experts implementation), right-padded batch, full-vocabulary log-softmax, the same
  on-policy policy-gradient loss, `backward`, gradient clipping and `torch.optim.AdamW`.

Goal (issue 45): the learner at most 1.0x transformers' time on both models. The weight push
is timed as `moe_rl.weights` streams it into a vLLM engine (`--push`: the demo trainer's
`time/sync` over the bytes it pushed) against a host copy of the same bytes.

    python -m bench.cpu.bench_vs_eager [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import at_once, markdown_table, write_results

MODELS = {  # name: (recipe, starting weights or None for the recipe's random init)
    "demo (4 layers, 8 experts top-2)": ("examples/tiny_rspo.yaml", "moe_rl/assets/tiny_base"),
    "ablation (8 layers, 64 experts top-16)": ("examples/ablations.yaml", None),
}


def demo_batch(seed: int = 0):
    """The demo step's shape (moe_rl_testing/workers/learner_bench_worker.py's batch), its advantages centred per
    group of 8 as GRPO's are."""
    from moe_rl_testing.workers.learner_bench_worker import rl_batch

    tokens, adv_B = rl_batch(seed)
    return tokens, (adv_B.view(-1, 8) - adv_B.view(-1, 8).mean(1, keepdim=True)).view(-1)


class LearnerUpdate:
    """One RL update of the learner, as `UpdatePhase` runs the on-policy step."""

    def __init__(self, cfg, layout, init: str | None, tokens, adv_B) -> None:
        from moe_rl.learner import Learner, load_start
        from moe_rl.programs.rl.policy_loss import PolicyLossFn

        self.cfg = cfg
        self.learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=1000)
        if init:
            load_start(self.learner, str(ROOT / init), trust=True)
        self.batch = self.learner.own_rows(tokens)
        self.batch = type(self.batch)(**{**self.batch.__dict__, "adv_B": adv_B[self.batch.row_ids_B]})
        self.loss_fn = PolicyLossFn(cfg.rl, cfg.sampler.max_new_tokens, on_policy=True)
        self.plan = self.learner.routing_plan("none", self.batch, capture=cfg.rl.records_routing)

    def __call__(self) -> None:
        self.learner.update(self.batch, self.loss_fn, self.plan, self.cfg.sampler.temperature)


class EagerUpdate:
    """The same update in transformers' eager Qwen3-MoE: forward, full-vocab log-softmax,
    on-policy policy-gradient loss, backward, clip, AdamW."""

    def __init__(self, learner, m, tokens, adv_B, clip: float, lr: float) -> None:
        import transformers

        from moe_rl.convert.layouts import layout_for
        from moe_rl.learner.export import hf_named_tensors

        hf_cfg = layout_for(m).hf_config(m, torch.float32, bos_token_id=None, eos_token_id=None, pad_token_id=0)
        state = {name: t.clone().contiguous() for name, t in hf_named_tensors(learner)}
        with tempfile.TemporaryDirectory() as tmp:  # transformers fuses the per-expert tensors on load
            (Path(tmp) / "config.json").write_text(json.dumps(hf_cfg))
            save_file(state, str(Path(tmp) / "model.safetensors"))
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.clip = clip
        self.ids_BS = tokens.tokens_BS
        self.attn_BS = (torch.arange(tokens.seq_len)[None, :] < tokens.total_lens_B[:, None]).long()
        self.targets_BS, self.mask_BS = _response_targets(tokens)
        self.adv_B = adv_B
        self.n_tokens = self.mask_BS.sum().clamp(min=1)

    def __call__(self) -> None:
        logits_BSV = self.model(input_ids=self.ids_BS, attention_mask=self.attn_BS).logits
        logp_BS = torch.log_softmax(logits_BSV[:, :-1].float(), -1).gather(-1, self.targets_BS[..., None])[..., 0]
        ratio_BS = torch.exp(logp_BS - logp_BS.detach())
        loss = -(self.adv_B[:, None] * ratio_BS * self.mask_BS).sum() / self.n_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _response_targets(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S-1] next-token targets and the mask of response positions (predicting token s+1)."""
    ids_BS = tokens.tokens_BS
    S = ids_BS.shape[1]
    pos_S = torch.arange(1, S)
    start_B = tokens.prompt_lens_B
    end_B = tokens.total_lens_B
    mask = ((pos_S[None, :] >= start_B[:, None]) & (pos_S[None, :] < end_B[:, None])).float()
    return ids_BS[:, 1:].long(), mask


def logprob_parity(learner, eager: EagerUpdate, tokens) -> float:
    """Largest |learner - transformers| log-probability over the response tokens at the
    starting weights: both sides run the same model (a mapping bug shows here, not as speed)."""
    ours_BT = learner.logprobs(tokens)
    with torch.no_grad():
        logits = eager.model(input_ids=eager.ids_BS, attention_mask=eager.attn_BS).logits
        theirs_BS = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, eager.targets_BS[..., None])[..., 0]
    T = ours_BT.shape[1]
    at_BT = (tokens.prompt_lens_B[:, None] - 1 + torch.arange(T)[None]).clamp(max=theirs_BS.shape[1] - 1)
    mask_BT = tokens.response_mask()
    return float(((theirs_BS.gather(1, at_BT) - ours_BT) * mask_BT).abs().max())


def interleaved(fns: dict, iters: int, warmup: int) -> dict[str, float]:
    """Median seconds of each callable, run round-robin so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def compare_model(recipe: str, init: str | None, iters: int, warmup: int) -> dict:
    from moe_rl.config import load_config
    from moe_rl.learner import parallel_layout

    cfg = load_config(ROOT / recipe, ["run.steps=1000"])
    tokens, adv_B = demo_batch()
    with parallel_layout(cfg.parallel, seed=0) as layout:
        ours = LearnerUpdate(cfg, layout, init, tokens, adv_B)
        eager = EagerUpdate(ours.learner, cfg.model, tokens, adv_B, cfg.optimizer.clip_grad, cfg.optimizer.lr)
        parity = logprob_parity(ours.learner, eager, tokens)
        med = interleaved({"learner": ours, "transformers": eager}, iters, warmup)
    return {"logprob_max_abs_diff": parity, "tokens": int(tokens.total_lens_B.sum()), "response_tokens": int(tokens.response_lens_B.sum()),
            "learner_s": med["learner"], "transformers_s": med["transformers"],
            "ratio": med["learner"] / med["transformers"]}


def demo_steps(tree: Path, steps: int, threads: int = 2) -> list[dict]:
    """The demo's metrics for `steps` steps (no saves) run from the source tree `tree`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "moe_rl.train", "--config", "examples/tiny_rspo.yaml", f"run.steps={steps}",
               f"run.output_dir={tmp}", "run.name=bench", "run.save_every=0", "logging.progress=false",
               "logging.tensorboard=false"]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS=str(threads), PYTHONPATH=str(tree),
                   TORCHDYNAMO_DISABLE="1")
        proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"the demo in {tree} failed:\n{proc.stderr[-3000:]}")
        return [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]


def baseline_tree(rev: str, into: Path) -> Path:
    """The repository's source at `rev`, extracted into `into` (git archive)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def host_copy_gbps(nbytes: int) -> float:
    """GB/s of one host copy of `nbytes` (the floor a weight push of that many bytes could reach)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    med = interleaved({"copy": lambda: dst.copy_(src)}, iters=20, warmup=3)["copy"]
    return nbytes / med / 1e9


def compare_steps(baseline: str, steps: int, skip: int, quick: bool = False) -> dict:
    """The demo's step in this tree and at `baseline`, back to back (`quick`: both at once); the
    weight push's GB/s against a host copy of the same bytes."""
    parts = ["step", "sample", "update", "sync", "reward", "other"]
    out: dict = {"baseline": baseline, "steps_timed": steps - skip}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT, f"baseline {baseline}": baseline_tree(baseline, Path(tmp))}
        hists = at_once({name: functools.partial(demo_steps, tree, steps, 1 if quick else 2)
                         for name, tree in trees.items()}, enabled=quick)  # (quick: a thread each)
        for name, hist in ((name, h[skip:]) for name, h in hists.items()):
            out[name] = {p: statistics.median(h.get(f"time/{p}", 0.0) for h in hist) for p in parts}
            out[name]["sync_bytes"] = hist[-1].get("sync/bytes_streamed", 0.0)
    ours, base = out["this tree"], out[f"baseline {baseline}"]
    out["step_ratio"] = ours["step"] / base["step"]
    out["push_gbps"] = ours["sync_bytes"] / ours["sync"] / 1e9 if ours["sync"] > 0 else 0.0
    out["host_copy_gbps"] = host_copy_gbps(int(ours["sync_bytes"]))
    return out


def step_only(baseline: str, quick: bool = False) -> None:
    """The demo step alone against `baseline` -> bench/results/step_vs_<baseline>.md (issue 69
    compares with 7d31198, the commit before its push: 38 ms there on a quiet day)."""
    steps, skip = (8, 3) if quick else (30, 5)
    step = compare_steps(baseline, steps, skip)
    parts = ("step", "sample", "update", "sync", "reward", "other")
    rows = [[name, *(step[name][p] * 1e3 for p in parts)] for name in ("this tree", f"baseline {baseline}")]
    rows.append(["this tree / baseline", *(step["this tree"][p] / step[f"baseline {baseline}"][p]
                                           if step[f"baseline {baseline}"][p] else float("nan") for p in parts)])
    table = markdown_table(["demo step (medians)", "step ms", "sample ms", "update ms", "push ms", "reward ms",
                            "other ms"], rows)
    notes = (f"`python -m moe_rl.train --config examples/tiny_rspo.yaml`, {steps} steps, medians of steps "
             f"{skip + 1}-{steps} (each part's median separately), this tree then `git archive {baseline}`, back "
             "to back, one process of 2 threads each. push = the trainer's `time/sync`.")
    write_results(f"step_vs_{baseline}", {"demo_step": step}, table, notes)


def main(quick: bool = False, baseline: str = "ff4e69c") -> None:
    from moe_rl.learner import init_distributed

    torch.set_num_threads(2)
    init_distributed("gloo")
    iters, warmup = (2, 1) if quick else (15, 3)
    # quick (make bench-smoke): the demo model only (the ablation model is the same code on a
    # larger shape), 3 demo steps per tree (1 warm-up)
    models = dict(list(MODELS.items())[:1]) if quick else MODELS
    results = {name: compare_model(recipe, init, iters, warmup) for name, (recipe, init) in models.items()}
    steps, skip = (3, 1) if quick else (30, 5)
    step = compare_steps(baseline, steps, skip, quick)
    rows = [[name, r["tokens"], r["learner_s"] * 1e3, r["transformers_s"] * 1e3, r["ratio"],
             r["logprob_max_abs_diff"]] for name, r in results.items()]
    table = markdown_table(["model", "tokens", "learner update ms", "transformers update ms",
                            "learner / transformers", "max |logprob diff|"], rows)
    step_rows = [[name, *(step[name][p] * 1e3 for p in ("step", "sample", "update", "sync", "reward", "other"))]
                 for name in ("this tree", f"baseline {baseline}")]
    table += "\n\n" + markdown_table(["demo step (medians)", "step ms", "sample ms", "update ms", "push ms",
                                        "reward ms", "other ms"], step_rows)
    table += "\n\n" + markdown_table(
        ["this tree / baseline step", "push MiB", "push GB/s", "host copy GB/s", "push / host copy"],
        [[step["step_ratio"], step["this tree"]["sync_bytes"] / 2**20, step["push_gbps"], step["host_copy_gbps"],
          step["push_gbps"] / step["host_copy_gbps"]]])
    notes = (f"Updates: medians of {iters} each after {warmup} warm-up, learner and transformers alternating in "
             "one process (2 threads); the logprob difference is at the starting weights. Demo step: `python -m "
             f"moe_rl.train --config examples/tiny_rspo.yaml`, {steps} steps, medians of steps {skip + 1}-{steps}, "
             f"this tree then `git archive {baseline}`, back to back. Push: the trainer's `time/sync` (assemble + "
             "stream into vLLM's reload_weights + the CPU MoE repack) over the bytes it streamed. Goals (issue 45): "
             "learner / transformers <= 1.0 on both models; this tree / baseline step <= 0.65.")
    write_results("vs_eager", {"updates": results, "demo_step": step}, table, notes)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline", default="ff4e69c", help="git revision whose demo step is the reference")
    ap.add_argument("--step-only", action="store_true", help="the demo step alone -> step_vs_<baseline>.md")
    args = ap.parse_args()
    if args.step_only:
        step_only(args.baseline, args.quick)
    else:
        main(args.quick, args.baseline)
