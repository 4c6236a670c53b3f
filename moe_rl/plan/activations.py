"""Activation memory of the learner's update pass: a formula, stated and sourced.

Base: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4: a GPT layer saves s*b*h*(34 + 5*a*s/h) bytes in 16-bit
(s tokens per sequence, b sequences per micro-batch, h hidden, a heads), divided by t under
tensor + sequence parallelism. Adapted to this learner (every term below is a tensor the
backward pass keeps, in the params dtype of e bytes unless marked fp32):

- no dropout (the learner sets hidden/attention dropout to 0): the mask terms (s*b*h each,
  and 1 byte per attention score) are gone;
- flash / fused attention (TE on GPU): the 2*a*s^2*b softmax terms are replaced by the
  attention output and a fp32 log-sum-exp per head and token;
- GQA and head_dim d: Q, K, V are a*d, g*d, g*d wide (not 3h); QK-RMSNorm keeps its inputs;
- RMSNorm keeps its input (s*b*h), as LayerNorm does;
- SwiGLU MLP of width F: fc1 input (h), fc1 output (2F: gate and up), activation output (F);
- MoE layer: router input (h, shared with the experts' input before dispatch) and fp32
  routing probabilities (E per token); each token is processed by K experts, so the routed
  experts keep K * (h fc1 input + 2F_e + F_e + h expert output, which the combine step keeps
  for the routing-weight gradient) per token, assuming balanced routing (a skewed router
  puts more tokens on the busiest rank); a shared expert is a SwiGLU MLP of width F_s.

Per layer (tokens = s*b, every term / t: sequence-parallel or head/column-sharded):
    attention = e*[2h + (a+2g)d + (a+g)d*qk_norm + a*d] + 4*a   (per token)
    dense MLP = e*[2h + 3F]
    MoE MLP   = e*[2h + K*(2h + 3F_e) + 3F_s] + 4E
Pipeline: 1F1B keeps min(pp - stage, micro-batches) micro-batches in flight on a stage
(Korthikanti et al. sec. 4.2.3). Full recompute (megatron's `recompute_granularity=full`,
uniform, one layer per checkpoint) keeps only each layer's input (e*h per token) plus one
layer's full activations while it is recomputed; each MoE layer also keeps the K expert ids
its forward routed each token to (1 byte each up to 256 experts, else 2), which the routing
taps force on the recomputed router (`moe_rl/learner/routing/taps.py`).

The logits are separate (last stage): the output layer's [b, s, V/t] logits, then the
learner's log-prob path on the T response positions: a gather, its fp32 copy, the
transposed copy for megatron's vocab-parallel cross entropy, and the normalised exp it saves.
"""

from __future__ import annotations

from moe_rl.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def attention_bytes_per_token(m: ModelConfig) -> int:
    e = DTYPE_BYTES[m.dtype_on(True)]
    a, g, d, h = m.num_attention_heads, m.num_query_groups, m.kv_channels, m.hidden_size
    qk_norm = (a + g) * d if m.qk_layernorm else 0
    return e * (2 * h + (a + 2 * g) * d + qk_norm + a * d) + 4 * a


def mlp_bytes_per_token(m: ModelConfig, moe: bool) -> int:
    e = DTYPE_BYTES[m.dtype_on(True)]
    h = m.hidden_size
    if not moe:
        return e * (2 * h + 3 * m.ffn_hidden_size)
    routed = m.moe_router_topk * (2 * h + 3 * m.moe_ffn_hidden_size)
    return e * (2 * h + routed + 3 * m.moe_shared_expert_intermediate_size) + 4 * m.num_experts


def layer_bytes(m: ModelConfig, tokens: int, tp: int, moe: bool) -> int:
    """Saved activations of one layer for one micro-batch of `tokens` (s*b) tokens."""
    return tokens * (attention_bytes_per_token(m) + mlp_bytes_per_token(m, moe)) // tp


def stage_activation_bytes(m: ModelConfig, *, tokens: int, tp: int, pp: int, stage: int,
                           layers: int, moe_layers: int, micro_batches: int, recompute: bool) -> int:
    """Peak saved activations on pipeline stage `stage` holding `layers` layers (of which
    `moe_layers` MoE) during the update, for micro-batches of `tokens` tokens."""
    in_flight = min(pp - stage, micro_batches)
    dense = layers - moe_layers
    per_moe, per_dense = layer_bytes(m, tokens, tp, True), layer_bytes(m, tokens, tp, False)
    if not recompute:
        return in_flight * (moe_layers * per_moe + dense * per_dense)
    e = DTYPE_BYTES[m.dtype_on(True)]
    inputs = in_flight * layers * tokens * e * m.hidden_size // tp
    routed_ids = in_flight * moe_layers * tokens * m.moe_router_topk * expert_id_bytes(m.num_experts) // tp
    return inputs + routed_ids + max(per_moe if moe_layers else 0, per_dense if dense else 0)


def expert_id_bytes(num_experts: int) -> int:
    """Bytes of one expert id as the learner keeps it (`moe_rl.routing.record.ids_dtype`:
    uint8 up to 256 experts, else int16), for the routing record and recompute's kept ids."""
    return 1 if num_experts <= 256 else 2


def logits_bytes(m: ModelConfig, *, micro_batch: int, seq_len: int, response_tokens: int, tp: int,
                 chunk_tokens: int = 0) -> int:
    """Peak of the logits and the log-prob computation on the last stage (one micro-batch).
    Chunked (`parallel.logprob_chunk_tokens` > 0): two [chunk, V/tp] fp32 blocks at most
    (forward, or the backward's recomputation and its gradient), whatever the token count,
    plus the selected hidden states. Full: the micro-batch's logits and their copies."""
    e = DTYPE_BYTES[m.dtype_on(True)]
    scored = micro_batch * response_tokens
    if chunk_tokens:
        return 2 * min(chunk_tokens, scored) * (m.vocab_size // tp) * 4 + 2 * scored * m.hidden_size * e
    per_position = micro_batch * m.vocab_size // tp
    gathered = e + (4 if e != 4 else 0) + 4 + 4  # gather, fp32 copy, transpose, saved softmax
    return per_position * (e * seq_len + gathered * response_tokens)
