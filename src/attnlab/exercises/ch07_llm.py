"""Tutorial 7, an LLM from a checkpoint folder: the exercises.

Fill in each function, then run ``attnlab exercises check 7`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import math
from pathlib import Path

import torch
from torch import Tensor

from attnlab.models import DecoderLM, from_pretrained

# --8<-- [end:imports]

EXERCISES = {
    "7.1": "precision_gap",
    "7.2": "kv_cache_bytes",
    "7.3": "my_top_p",
    "7.4": "shift_difference",
    "7.5": ["rms_norm", "rope", "swiglu", "decoder_block"],
    "7.6": "decoder_only_example",
}


# --8<-- [start:precision_gap]
def precision_gap(folder: Path, input_ids: Tensor) -> tuple[float, bool]:
    """Load the checkpoint ``folder`` in float32 and in bfloat16, run both on ``input_ids``
    (``B x L``) and return (the largest |logit difference|, whether the greedy token, the
    argmax, is the same at every position)."""
    m32 = from_pretrained(folder, dtype="float32")
    m16 = from_pretrained(folder, dtype="bfloat16")
    with torch.no_grad():
        z32, z16 = m32(input_ids), m16(input_ids).float()
    return (z32 - z16).abs().max().item(), torch.equal(z32.argmax(-1), z16.argmax(-1))
# --8<-- [end:precision_gap]


# --8<-- [start:kv_cache_bytes]
def kv_cache_bytes(tokens: int, layers: int, kv_heads: int, head_dim: int,
                   element_bytes: int) -> int:
    """The bytes of a KV cache for ``tokens`` positions of one sequence: keys and values,
    for every layer, ``kv_heads`` (G) heads of ``head_dim`` (D) elements each."""
    return 2 * layers * kv_heads * head_dim * element_bytes * tokens
# --8<-- [end:kv_cache_bytes]


# --8<-- [start:my_top_p]
def my_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering over the last dim: keep the most likely tokens while the probability
    mass BEFORE a token (in decreasing order) is below ``p`` (the top token is always kept);
    the others' logits become -inf. Shape and dtype of ``logits``."""
    q, order = torch.softmax(logits, -1).sort(descending=True)
    keep_sorted = (q.cumsum(-1) - q) < p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))
# --8<-- [end:my_top_p]


# --8<-- [start:shift_difference]
def shift_difference(model: DecoderLM, input_ids: Tensor, shift: int) -> float:
    """The largest |logit difference| between running ``model`` on ``input_ids`` (``B x L``)
    at positions 0..L-1 and at positions shift..shift+L-1 (``position_ids``)."""
    L = input_ids.shape[1]
    with torch.no_grad():
        plain = model(input_ids)
        shifted = model(input_ids, position_ids=torch.arange(shift, shift + L)[None])
    return (plain - shifted).abs().max().item()
# --8<-- [end:shift_difference]


# --8<-- [start:decoder_block]
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x²) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: Tensor, base: float) -> Tensor:
    """RoPE in the half-split layout of Llama and Qwen2: x ``B x H x L x D`` at positions
    0..L-1; feature i of the first half pairs with feature i + D/2 and the pair turns by the
    angle position * base^(-2i/D)."""
    L, D = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = torch.arange(L, dtype=torch.float32)[:, None] * inv_freq  # L x D/2
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # L x D
    turned = torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)
    return x * cos + turned * sin


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """W_down (silu(W_gate x) * W_up x); the weights are stored ``out x in``."""
    return (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def decoder_block(x: Tensor, weights: dict[str, Tensor], *, num_heads: int,
                  num_kv_heads: int, rope_base: float, eps: float) -> Tensor:
    """One pre-norm decoder block of the Llama/Qwen2 layout, from its weights (the block's
    ``state_dict``: ``input_layernorm.weight``, ``self_attn.{q,k,v}_proj.weight`` and
    ``.bias`` when there is one, ``self_attn.o_proj.weight``, ``post_attention_layernorm.weight``,
    ``mlp.{gate,up,down}_proj.weight``): x ``B x L x E`` at positions 0..L-1 -> ``B x L x E``.

    h = x + Attn(RMSNorm(x)) with causal grouped-query attention (H query heads, G key/value
    heads, query head j reads key/value head j // (H / G)) and RoPE on queries and keys; then
    h + SwiGLU(RMSNorm(h))."""
    B, L, _ = x.shape
    H, G = num_heads, num_kv_heads

    def project(name: str, heads: int) -> Tensor:  # B x heads x L x D
        y = x_norm @ weights[f"self_attn.{name}.weight"].T
        if f"self_attn.{name}.bias" in weights:
            y = y + weights[f"self_attn.{name}.bias"]
        return y.view(B, L, heads, -1).transpose(1, 2)

    x_norm = rms_norm(x, weights["input_layernorm.weight"], eps)
    q, k, v = project("q_proj", H), project("k_proj", G), project("v_proj", G)
    q, k = rope(q, rope_base), rope(k, rope_base)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    z = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    h = x + z.transpose(1, 2).reshape(B, L, -1) @ weights["self_attn.o_proj.weight"].T
    return h + swiglu(rms_norm(h, weights["post_attention_layernorm.weight"], eps),
                      weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"],
                      weights["mlp.down_proj.weight"])
# --8<-- [end:decoder_block]


# --8<-- [start:decoder_only_example]
def decoder_only_example(src_ids: Tensor, tgt_ids: Tensor, sep_id: int) -> tuple[Tensor, Tensor]:
    """A translation pair as one decoder-only training sequence: ``input_ids`` = the source,
    ``sep_id``, the target (1-D); ``labels`` = ``input_ids`` with -100 (no loss) on the source
    and the separator, so that the model learns to write the target only (``DecoderLM``
    shifts the labels inside: position t is scored on predicting token t from tokens < t)."""
    input_ids = torch.cat([src_ids, torch.tensor([sep_id]), tgt_ids])
    labels = input_ids.clone()
    labels[:len(src_ids) + 1] = -100
    return input_ids, labels
# --8<-- [end:decoder_only_example]
