"""The transformers sampler: the reference, and the one that returns routed experts on CPU.

A plain batched decoding loop over `AutoModelForCausalLM` with a KV cache. Prompts are
left-padded (positions count real tokens only, padded keys are masked), each response row
draws its noise from its own generator seeded by `base.sample_seeds`, so a row's sample
does not depend on batching. A token is drawn by the exponential race (argmax of p / q with
q ~ Exp(1), the same scheme vLLM uses) from `softmax(logits / T)` after top-p truncation,
and its logprob is read from that same distribution (see `base.py`).

Routed experts come from forward hooks on each MoE layer's router (`mlp.gate`). Qwen3-MoE's
router returns `(logits, weights, top-k ids)`; the hook keeps the ids the model itself used
(for a router that returns only logits it recomputes them as the model does:
`topk(softmax(logits), K)`). They are laid out as vLLM returns them: `[positions fed,
num_hidden_layers, K]` indexed by decoder-layer number (rows of dense layers stay 0), as
uint8 (uint16 above 256 experts), with padding positions and positions fed after a row
finished left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moe_rl.runtime.fault_hooks import engine_fail_point
from moe_rl.sampler.base import Rollouts, base_seeds, check_generate_args, expand_seeds, resolve_eos
from moe_rl.sampler.engine_config import HFEngineConfig
from moe_rl.sampler.precision import precision_dtype, transform_weights
from moe_rl.sampler.weights import iter_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model.layers.3.mlp.experts.5.gate_proj.weight -> ("model.layers.3.mlp.experts", 5, "gate")
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def top_p_filter(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus to -inf (vLLM's rule: drop the smallest tokens
    while the mass below them stays <= 1 - p; the most likely token always survives)."""
    if top_p >= 1.0:
        return logits_BV
    sorted_BV, order_BV = logits_BV.sort(dim=-1)
    cum_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
    drop_BV = cum_BV <= 1 - top_p
    drop_BV[:, -1] = False
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    return torch.empty_like(logits_BV).scatter_(-1, order_BV, sorted_BV)


class _RouterCapture:
    """Forward hooks that record each MoE router's top-k ids, per forward call."""

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.top_k: int = cfg.num_experts_per_tok
        num_experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts  # Qwen3-MoE / Glm4-MoE
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.enabled = False
        self.calls: list[dict[int, torch.Tensor]] = []  # per forward: {layer: ids [B*S, K]}
        self._handles = []
        for layer_id, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(layer.mlp, "experts"):
                self._handles.append(gate.register_forward_hook(self._hook(layer_id)))
        self.moe_layers = len(self._handles)

    def _hook(self, layer_id: int):
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            if not self.enabled:
                return
            if isinstance(output, tuple) and len(output) >= 3:
                ids = output[2]
            else:  # a router that returns logits only: recompute its top-k
                logits = output[0] if isinstance(output, tuple) else output
                ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1).indices
            self.calls[-1][layer_id] = ids.detach().reshape(-1, self.top_k).to(torch.int32)

        return hook

    def new_call(self) -> None:
        if self.enabled:
            self.calls.append({})

    def stacked(self, call: dict[int, torch.Tensor], B: int) -> torch.Tensor:
        """One forward's ids as `[B, S, num_layers, K]` (dense layers 0)."""
        any_ids = next(iter(call.values()))
        S = any_ids.shape[0] // B
        out = torch.zeros(B, S, self.num_layers, self.top_k, dtype=torch.int32)
        for layer_id, ids in call.items():
            out[:, :, layer_id] = ids.reshape(B, S, self.top_k)
        return out


class HFSampler:
    """`Sampler` on a transformers model, run as `config` says (`HFEngineConfig`)."""

    name = "transformers"
    returns_routed_experts = True
    _named: dict[str, torch.Tensor] | None
    """`held_tensor`'s name -> tensor map, built on its first call."""

    def __init__(self, model_dir: str | Path, config: HFEngineConfig | None = None) -> None:
        from transformers import AutoModelForCausalLM

        config = config or HFEngineConfig()
        self.config = config
        self.model_dir = str(model_dir)
        self.precision = config.precision
        self.eos_token_ids = resolve_eos(model_dir, config.eos_token_ids)
        self.batch_size = config.batch_size
        self.device = torch.device(config.device)
        self._seed_stream = np.random.default_rng(config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=precision_dtype(config.precision), attn_implementation=config.attn_implementation
        ).to(self.device)  # type: ignore[arg-type]  # (transformers types .to as a decorated method: it takes a device)
        self.model.eval().requires_grad_(False)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._routers = _RouterCapture(self.model)
        if config.precision == "fp8_emulated":
            self.update_weights(iter_checkpoint(self.model_dir))

    # ----------------------------------------------------------------- protocol

    @torch.inference_mode()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        prompt_seeds: Sequence[int] | None = None,
    ) -> Rollouts:
        engine_fail_point()  # (a test hook: a no-op unless asked for)
        check_generate_args(n, max_new_tokens, temperature, top_p)
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if any(not p for p in prompts):
            raise ValueError("generate: empty prompt")
        if prompt_seeds is None:
            if seed is None:
                seed = int(self._seed_stream.integers(2**31))
            prompt_seeds = base_seeds(seed, len(prompts), n)
        seeds = expand_seeds(prompt_seeds, len(prompts), n)
        rows = [prompts[i] for i in range(len(prompts)) for _ in range(n)]
        responses, logprobs, finish, routed = [], [], [], []
        for start in range(0, len(rows), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            r, lp, f, re_ = self._generate_rows(rows[chunk], seeds[chunk], max_new_tokens, temperature, top_p)
            responses += r
            logprobs += lp
            finish += f
            routed += re_
        return Rollouts(
            prompt_token_ids=prompts,
            prompt_index=[i for i in range(len(prompts)) for _ in range(n)],
            response_token_ids=responses,
            logprobs=logprobs,
            finish_reasons=finish,
            routed_experts=routed,
        )

    @torch.inference_mode()
    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        response_token_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Teacher-forced `log_softmax(logits / T)` of each response token (right-padded
        batches; a causal model's real positions do not see the padding)."""
        if len(prompt_token_ids) != len(response_token_ids):
            raise ValueError("score: one prompt per response")
        seqs = [([int(t) for t in p], [int(t) for t in r]) for p, r in zip(prompt_token_ids, response_token_ids)]
        out: list[list[float]] = []
        for start in range(0, len(seqs), self.batch_size):
            batch = seqs[start : start + self.batch_size]
            T = max(len(p) + len(r) for p, r in batch)
            ids_BT = torch.zeros(len(batch), T, dtype=torch.long)
            mask_BT = torch.zeros(len(batch), T, dtype=torch.long)
            for b, (p, r) in enumerate(batch):
                ids_BT[b, : len(p) + len(r)] = torch.tensor(p + r)
                mask_BT[b, : len(p) + len(r)] = 1
            logits_BTV = self.model(
                input_ids=ids_BT.to(self.device), attention_mask=mask_BT.to(self.device)
            ).logits.float()
            logp_BTV = torch.log_softmax(logits_BTV / temperature, dim=-1).cpu()
            for b, (p, r) in enumerate(batch):
                pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)
                out.append(logp_BTV[b, pos, torch.tensor(r, dtype=torch.long)].tolist())
        return out

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; per-expert checkpoint tensors go into
        transformers' fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(self.model.named_buffers())  # Glm4-MoE's e_score_correction_bias is a buffer
        for name, w in transform_weights(named_tensors, self.precision):
            if name in params:
                params[name].copy_(w)
                continue
            m = _EXPERT_WEIGHT.match(name)
            if m is None or f"{m.group(1)}.down_proj" not in params:
                raise KeyError(f"update_weights: {name!r} matches no parameter of {type(self.model).__name__}")
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj == "down":
                params[f"{prefix}.down_proj"][e].copy_(w)
            else:
                gate_up = params[f"{prefix}.gate_up_proj"]
                inter = gate_up.shape[1] // 2
                rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
                gate_up[e, rows].copy_(w)

    def held_tensor(self, name: str) -> torch.Tensor:
        """The tensor this engine computes with for HF checkpoint name `name` (a view into
        the fused expert tensors for a per-expert name): what `update_weights` wrote."""
        params = getattr(self, "_named", None)
        if params is None:  # (kept: update_weights copies into these tensors in place)
            params = self._named = dict(self.model.named_parameters(remove_duplicate=False))
            params.update(self.model.named_buffers())
        if name in params:
            return params[name]
        m = _EXPERT_WEIGHT.match(name)
        if m is None or f"{m.group(1)}.down_proj" not in params:
            raise KeyError(f"held_tensor: {name!r} matches no parameter of {type(self.model).__name__}")
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            return params[f"{prefix}.down_proj"][e]
        gate_up = params[f"{prefix}.gate_up_proj"]
        inter = gate_up.shape[1] // 2
        return gate_up[e, :inter] if proj == "gate" else gate_up[e, inter:]

    def close(self) -> None:
        self.model, self._named = None, None

    # ----------------------------------------------------------------- decoding

    def _generate_rows(
        self, rows: list[list[int]], seeds: list[int], max_new_tokens: int, temperature: float, top_p: float
    ) -> tuple[list[list[int]], list[list[float]], list[str], list[np.ndarray]]:
        B = len(rows)
        lens_B = torch.tensor([len(r) for r in rows])
        P = int(lens_B.max())
        ids_BP = torch.zeros(B, P, dtype=torch.long)
        mask_BT = torch.zeros(B, P, dtype=torch.long)
        for b, r in enumerate(rows):  # left padding: every row's last prompt token at P-1
            ids_BP[b, P - len(r) :] = torch.tensor(r)
            mask_BT[b, P - len(r) :] = 1
        pos_BP = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long)
        budget_B = (self.max_len - lens_B).clamp(max=max_new_tokens)

        caps = self._routers
        caps.enabled, caps.calls = True, []
        caps.new_call()
        out = self.model(
            input_ids=ids_BP.to(self.device),
            attention_mask=mask_BT.to(self.device),
            position_ids=pos_BP.to(self.device),
            use_cache=True,
        )
        cache, last_pos_B = out.past_key_values, pos_BP[:, -1]
        tokens: list[torch.Tensor] = []  # per step [B]
        logps: list[torch.Tensor] = []
        done_B = torch.zeros(B, dtype=torch.bool)
        length_B = torch.zeros(B, dtype=torch.long)  # response length once done
        for step in range(max_new_tokens):
            tok_B, logp_BV = _next_tokens(out.logits[:, -1].float().cpu(), gens, temperature, top_p)
            tokens.append(tok_B)
            logps.append(logp_BV.gather(1, tok_B[:, None])[:, 0])
            stop_B = torch.isin(tok_B, eos) | (step + 1 >= budget_B)
            newly_B = stop_B & ~done_B
            length_B[newly_B] = step + 1
            done_B |= stop_B
            if bool(done_B.all()):
                break
            mask_BT = torch.cat([mask_BT, torch.ones(B, 1, dtype=torch.long)], dim=1)
            last_pos_B = last_pos_B + 1
            caps.new_call()
            out = self.model(
                input_ids=tok_B[:, None].to(self.device),
                attention_mask=mask_BT.to(self.device),
                position_ids=last_pos_B[:, None].to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
        caps.enabled = False

        tok_BS, logp_BS = torch.stack(tokens, 1), torch.stack(logps, 1)
        responses, logprobs, finish, routed = [], [], [], []
        prefill = caps.stacked(caps.calls[0], B)  # [B, P, L, K]
        decode = [caps.stacked(c, B) for c in caps.calls[1:]]  # each [B, 1, L, K]
        for b in range(B):
            R = int(length_B[b])
            ids = tok_BS[b, :R].tolist()
            responses.append(ids)
            logprobs.append(logp_BS[b, :R].tolist())
            finish.append("stop" if ids[-1] in self.eos_token_ids else "length")
            # fed positions: the real prompt tokens, then response tokens 0 .. R-2
            rows_SLK = [prefill[b, P - int(lens_B[b]) :]] + [d[b] for d in decode[: R - 1]]
            routed.append(torch.cat(rows_SLK, dim=0).numpy().astype(caps.dtype))
        caps.calls = []
        return responses, logprobs, finish, routed


def _next_tokens(logits_BV: torch.Tensor, gens: list[torch.Generator], temperature: float,
                 top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled token of each row and the log-distribution it came from. Temperature 0 is
    greedy decoding (evaluation): the argmax, with the T=1 log-distribution reported."""
    if temperature == 0:
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        return logp_BV.argmax(dim=-1), logp_BV
    logp_BV = torch.log_softmax(top_p_filter(logits_BV / temperature, top_p), dim=-1)
    q_BV = torch.stack([torch.empty(logp_BV.shape[1]).exponential_(generator=g) for g in gens])
    return (logp_BV.exp() / q_BV).argmax(dim=-1), logp_BV
