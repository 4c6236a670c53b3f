"""How fast a critic of the tiny model learns PPO's value: offline, on a fixed policy's
rollouts, measured as held-out explained variance (why `examples/tiny_ppo.yaml`'s critic
stays near 0.2, docs/ppo_dpo.md).

    python -m bench.run_all critic            # about 18 minutes on 2 CPUs
    python -m bench.run_all critic --quick    # smoke-sized

Rollouts: the shipped base policy (`moe_rl/assets/tiny_base`, exported to Hugging Face by
`moe_rl.convert`) answers 4096 training and 128 held-out reversal problems (4-6 digits,
different seeds) 8 times each at temperature 1 (`tools/value_ceiling.sample_rollouts`).

Critic: that policy's transformer in `transformers` (the same weights the learner starts
PPO's critic from) with a zero-initialised linear head on the final hidden state at each
response token's scoring slot (the state before the token), as `moe_rl.learner.critic`
reads it. Every update draws B training rollouts, takes one Adam step (gradient norm
clipped at 1) on the variant's loss over their response tokens, and every E updates the
held-out explained variance of the Monte-Carlo returns (the exact-match reward on every
response token) is measured. The variants:

    mse         0.5 (V - R)^2, the value loss PPO uses (unclipped: the policy is fixed);
    bce         a sigmoid head, binary cross-entropy against the 0/1 return;
    hl_gauss    a 51-bin categorical head on [-0.5, 1.5], cross-entropy against the
                return's Gaussian histogram (sigma 0.75 bins; Farebrother et al. 2024);
    on_track    mse against whether the prefix is still the answer's (exact 0/1 labels
                instead of the noisy return): how fast the architecture learns to spot a
                wrong digit at all; its explained variance is of the best affine map of V;
    one more layer  mse with a fifth decoder layer on top (a copy of the last one whose
                attention output and expert down-projections start at zero, so the critic
                starts as the base): is checking the digit just written one layer deeper
                than writing it?
    likelihood  mse, the head also reading the log-probability the trunk's own output
                layer (kept, trainable) gave the token at that slot and its gap to the most
                likely token: the policy's own surprise at the digit just written.

Each variant runs in its own process at one torch thread, two at a time.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.programs.ppo.gae import explained_variance
from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
HL_BINS, HL_LOW, HL_HIGH = 51, -0.5, 1.5

VARIANTS: dict[str, dict[str, Any]] = {
    "mse, lr 1e-3, batch 128": {"loss": "mse", "lr": 1e-3, "batch": 128, "long": True},
    "mse, batch 32 (4x the updates, the same rollouts)": {"loss": "mse", "lr": 1e-3, "batch": 32, "scale": 4},
    "mse, lr 2e-3 cosine to 1e-4": {"loss": "mse", "lr": 2e-3, "batch": 128, "cosine": 0.05},
    "bce (sigmoid head)": {"loss": "bce", "lr": 1e-3, "batch": 128},
    "hl_gauss (51 bins)": {"loss": "hl_gauss", "lr": 1e-3, "batch": 128},
    "on_track labels (exact 0/1)": {"loss": "mse", "lr": 1e-3, "batch": 128, "labels": "on_track"},
    "mse, one more layer (identity at the start)": {"loss": "mse", "lr": 1e-3, "batch": 128, "extra_layer": True},
    "mse, head also reads the trunk's log-prob of the token": {"loss": "mse", "lr": 1e-3, "batch": 128,
                                                              "likelihood": True},
}


def _value_ceiling() -> Any:
    spec = importlib.util.spec_from_file_location("value_ceiling", ROOT / "tools" / "value_ceiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rollouts(policy: Path, prompts: int, seed: int) -> list[tuple[list[int], list[int], float, list[bool]]]:
    """(prompt ids, response ids, reward, on-track flag per response token) per rollout."""
    vc = _value_ceiling()
    return [(r.prompt, r.response, r.reward, vc.on_track(r.answer, r.response))
            for r in vc.sample_rollouts(policy, "reverse", prompts, 8, seed, with_answer_p=False)]


def batchify(rows: list, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [b, L], the scoring-slot mask, the return and the on-track label at each slot."""
    length = max(len(p) + len(r) for p, r, _, _ in rows)
    ids = torch.full((len(rows), length), pad)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    ret, track = torch.zeros(len(rows), length), torch.zeros(len(rows), length)
    for i, (p, r, reward, on) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        slots = slice(len(p) - 1, len(p) + len(r) - 1)  # (the state before each response token)
        mask[i, slots] = True
        ret[i] = reward
        track[i, slots] = torch.tensor(on, dtype=torch.float32)
    return ids, mask, ret, track


def append_identity_layer(trunk: torch.nn.Module) -> None:
    """A copy of the trunk's last decoder layer on top, its residual branches' output
    projections zeroed so that the deeper trunk computes what the base's does."""
    layer = copy.deepcopy(trunk.layers[-1])
    layer.self_attn.layer_idx = len(trunk.layers)
    torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
    for name, param in layer.mlp.named_parameters():
        if "down" in name:
            torch.nn.init.zeros_(param)
    trunk.layers.append(layer)
    trunk.config.num_hidden_layers += 1


def token_surprise(logits_BLV: torch.Tensor, ids_BL: torch.Tensor) -> torch.Tensor:
    """[B, L, 2]: at each position, the log-probability the previous position's logits gave
    this token, and its gap to the most likely token (0 at the first position)."""
    logp = logits_BLV[:, :-1].log_softmax(-1)
    token_lp = logp.gather(-1, ids_BL[:, 1:, None])[..., 0]
    out = torch.zeros(*ids_BL.shape, 2)
    out[:, 1:, 0] = token_lp
    out[:, 1:, 1] = token_lp - logp.max(-1).values
    return out


class ProbeCritic(torch.nn.Module):
    def __init__(self, policy: Path, loss: str, extra_layer: bool = False, likelihood: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        lm = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
        self.trunk = lm.model
        self.output_layer = lm.lm_head if likelihood else None
        if extra_layer:
            append_identity_layer(self.trunk)
        self.loss = loss
        features = self.trunk.config.hidden_size + (2 if likelihood else 0)
        self.head = torch.nn.Linear(features, HL_BINS if loss == "hl_gauss" else 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.centers = torch.linspace(HL_LOW, HL_HIGH, HL_BINS)
        width = (HL_HIGH - HL_LOW) / (HL_BINS - 1)
        self.edges = torch.linspace(HL_LOW - width / 2, HL_HIGH + width / 2, HL_BINS + 1)
        self.sigma = 0.75 * width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=ids).last_hidden_state
        if self.output_layer is not None:
            hidden = torch.cat([hidden, token_surprise(self.output_layer(hidden), ids)], -1)
        return self.head(hidden)

    def value(self, out: torch.Tensor) -> torch.Tensor:
        if self.loss == "hl_gauss":
            return (out.softmax(-1) * self.centers).sum(-1)
        return torch.sigmoid(out[..., 0]) if self.loss == "bce" else out[..., 0]

    def objective(self, out: torch.Tensor, target_N: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.loss == "mse":
            return 0.5 * ((out[..., 0][mask] - target_N) ** 2).mean()
        if self.loss == "bce":
            return torch.nn.functional.binary_cross_entropy_with_logits(out[..., 0][mask], target_N)
        cdf = torch.special.erf((self.edges[None, :] - target_N[:, None]) / (math.sqrt(2) * self.sigma))
        hist = cdf[:, 1:] - cdf[:, :-1]
        hist = hist / hist.sum(-1, keepdim=True)
        return -(hist * out[mask].log_softmax(-1)).sum(-1).mean()


def held_out_scores(critic: ProbeCritic, held: tuple, affine: bool) -> dict[str, float]:
    """Explained variance of the held-out returns by V (or by the best affine map of V)."""
    ids, mask, ret, track = held
    with torch.no_grad():
        v, r = critic.value(critic(ids))[mask].double(), ret[mask].double()
    out = {}
    if affine:
        out["on_track_accuracy"] = float(((v > 0.5) == (track[mask] > 0.5)).double().mean())
        design = torch.stack([v, torch.ones_like(v)], 1)
        v = design @ torch.linalg.lstsq(design, r[:, None]).solution[:, 0]
    return {"ev": explained_variance(v, r, torch.ones_like(r, dtype=torch.bool)), **out}


def fit(name: str, spec: dict[str, Any], policy: str, data: tuple, updates: int, every: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, held, pad = data
    held_t = batchify(held, pad)
    critic = ProbeCritic(Path(policy), spec["loss"], spec.get("extra_layer", False), spec.get("likelihood", False))
    opt = torch.optim.Adam(critic.parameters(), lr=spec["lr"])
    rng = np.random.default_rng(0)
    scale = spec.get("scale", 1)
    total = updates * scale * (5 if spec.get("long") else 1)
    curve, t0 = [], time.perf_counter()
    for u in range(1, total + 1):
        if spec.get("cosine"):
            floor = spec["cosine"]
            for group in opt.param_groups:
                group["lr"] = spec["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * u / total)))
        ids, mask, ret, track = batchify([train[i] for i in rng.choice(len(train), spec["batch"], replace=False)],
                                         pad)
        target = (track if spec.get("labels") == "on_track" else ret)[mask]
        loss = critic.objective(critic(ids), target, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        if u % (every * scale) == 0:
            point = held_out_scores(critic, held_t, affine=spec.get("labels") == "on_track")
            curve.append({"rollouts_seen": u * spec["batch"], "updates": u, **point})
    return {"variant": name, **spec, "curve": curve, "seconds": time.perf_counter() - t0}


def main(quick: bool = False) -> None:
    from transformers import AutoTokenizer

    from moe_rl.convert import megatron_to_hf

    # quick (make bench-smoke): every variant, 4 updates each (one held-out point; the long run 20),
    # on 32 training and 16 held-out rollouts, batches capped at the 32 rollouts there are
    prompts, held_prompts, updates, every = (4, 2, 4, 4) if quick else (4096, 128, 600, 100)
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "tiny_base_hf"
        megatron_to_hf(str(BASE), str(policy), progress=False)
        t0 = time.perf_counter()
        train, held = rollouts(policy, prompts, seed=11), rollouts(policy, held_prompts, seed=12)
        sampled_s = time.perf_counter() - t0
        data = (train, held, AutoTokenizer.from_pretrained(policy).eos_token_id)
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
            specs = {name: {**spec, "batch": min(spec["batch"], len(train))} for name, spec in VARIANTS.items()}
            jobs = [pool.submit(fit, name, spec, str(policy), data, updates, every) for name, spec in specs.items()]
            results = [job.result() for job in jobs]
    reward = float(np.mean([r for _, _, r, _ in train]))
    marks = [every * k for k in (1, 3, 6)]
    rows = []
    for res in results:
        at = {p["updates"] // res.get("scale", 1): p["ev"] for p in res["curve"]}
        rows.append([res["variant"], *[round(at.get(m, float("nan")), 3) for m in marks],
                     round(res["curve"][-1]["ev"], 3), res["curve"][-1]["updates"], round(res["seconds"])])
    header = ["variant", *[f"EV after {m * 128} rollouts" for m in marks], "EV at the end", "updates", "seconds"]
    long = next(r for r in results if r.get("long"))
    labelled = next(r for r in results if r.get("labels") == "on_track")
    notes = (f"Base-policy rollouts: {len(train)} training (reward {reward:.3f}), {len(held)} held out; sampled in "
             f"{sampled_s:.0f} s. EV: held-out explained variance of the Monte-Carlo returns "
             "(on_track: of the best affine map of V; its held-out accuracy at the end "
             f"{labelled['curve'][-1]['on_track_accuracy']:.3f}). The long mse run: "
             + ", ".join(f"{p['updates']} -> {p['ev']:.3f}" for p in long["curve"][2::3]))
    write_results("critic", {"rollouts": len(train), "held_out": len(held), "reward": reward,
                             "sample_seconds": sampled_s, "results": results}, markdown_table(header, rows), notes)
