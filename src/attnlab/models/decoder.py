"""The one decoder-only causal LM of attnlab; every model family is this stack, configured.

``DecoderLM(config)(input_ids B x L) -> logits B x L x V``. Each block is pre-norm:

    x = x + Dropout(SelfAttention(Norm(x)))   causal, GQA when G < H, RoPE or learned positions
    x = x + Dropout(MLP(Norm(x)))             two-layer (GELU/ReLU) or gated (SwiGLU, GeGLU)

followed by a final norm and ``lm_head`` (tied to the token embedding or not). What differs
between GPT-2, Llama, Mistral, Qwen2/3, Gemma and Phi-3 is data in ``DecoderLMConfig``: the
norm (LayerNorm, RMSNorm, Gemma's ``1 + w`` RMSNorm), the MLP, the biases, q/k norms, the
positions (RoPE with scaling, or learned), an embedding scale, a sliding window.
``attnlab.models.families`` maps each family's ``config.json`` and weight names onto it.

Positions: ``attention_mask`` (``B x (offset + L)``, 1 = real token) gives each real token
the position ``(number of real tokens before it)``, so a left-padded prompt starts at 0, as
Hugging Face's ``generate`` does; without a mask the positions are ``offset .. offset + L - 1``.
The rotary ``(cos, sin)`` and the attention mask are computed once per forward.

This module is the formula. Speed comes from fast modules with the same signatures that
``attnlab.kernels.optimize_for_inference`` swaps in (``from_pretrained`` does, unless
``kernels=False``), ``layers`` among them: ``FusedDecoderLayers`` runs a one-token step
through every block in one C++ call.

Hook points (``HookPoint`` modules, see ``attnlab.analysis.hooks``): ``layers.{i}.resid_pre``,
``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post`` (``B x L x E``) and, inside
``layers.{i}.self_attn``, ``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab._checks import check_token_ids
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.paged import LayerPages
from attnlab.generation import GreedyTokens, generate
from attnlab.hook_point import HookPoint, global_hooks
from attnlab.layers import (
    FeedForward,
    GatedMLP,
    LearnedPositionalEmbedding,
    RMSNorm,
    initialisation,
)
from attnlab.layers.self_attention import SelfAttention
from attnlab.masks import decoder_mask
from attnlab.models.decoder_config import GATED, DecoderLMConfig, make_rotary
from attnlab.models.families.loading import load_family, save_family
from attnlab.models.gguf import gguf_file, load_gguf
from attnlab.models.gguf_export import export_gguf
from attnlab.models.hf_loading import (
    CONFIG_NAME,
    check_folder,
    parse_device,
    parse_dtype,
    read_json,
)
from attnlab.models.inputs import decoder_inputs
from attnlab.models.outputs import (
    CausalLMOutput,
    check_hf_keywords,
    check_labels,
    next_token_loss,
)
from attnlab.models.pretrained import PreTrainedModel, install_kernels, requested_quantization
from attnlab.models.summary import summary

__all__ = ["DecoderBlock", "DecoderLM", "DecoderLMConfig", "DecoderLayers", "make_norm",
           "make_rotary"]

class DecoderLM(PreTrainedModel):
    """Causal LM: ``forward(input_ids B x L, attention_mask, *, cache, ...) -> logits B x L x V``.

    Submodules (Hugging Face's names): ``embed_tokens``, ``embed_positions`` (learned
    positions only), ``layers[i]`` (``input_layernorm``, ``self_attn`` with ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj``, ``post_attention_layernorm``, ``mlp``), ``norm``,
    ``lm_head``, and ``greedy`` (``GreedyTokens``: the greedy choice of ``generate``). New
    weights are drawn as Hugging Face does: ``N(0, initializer_range^2)`` for linear and
    embedding weights, zero biases, unit norms.

    The Hugging Face call surface: ``model(ids, attention_mask=, labels=, past_key_values=,
    use_cache=)`` returns a ``CausalLMOutput`` (``attnlab.models.outputs``: ``loss``,
    ``logits``, ``past_key_values``); ``generate``; ``save_pretrained``/``from_pretrained``
    (attnlab's own format, ``attnlab.models.pretrained``).
    """

    MODEL_TYPE = "attnlab_decoder"
    CONFIG_CLASS = DecoderLMConfig

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderLMConfig):
            raise TypeError(f"config: expected a DecoderLMConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = initialisation.embedding(c.vocab_size, c.d_model)
        self.embed_positions = (LearnedPositionalEmbedding(c.max_len, c.d_model)
                                if c.position == "learned" else None)
        self.rotary = make_rotary(c)
        self.drop = nn.Dropout(c.dropout)
        self.layers = DecoderLayers(DecoderBlock(c) for _ in range(c.num_layers))
        self.norm = make_norm(c, c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.greedy = GreedyTokens()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Hugging Face's initialisation; ties ``lm_head`` to ``embed_tokens`` when asked."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                initialisation.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, LearnedPositionalEmbedding):
                initialisation.normal_(module.weight, std=std)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                labels: Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None,
                cache: KVCache | None = None, position_ids: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor | CausalLMOutput:
        """input_ids ``B x L`` -> logits ``B x L x V`` (``B x min(k, L) x V`` for ``k > 0``).

        ``attention_mask``: ``B x (offset + L)``, 1/True = real token (covering the cached
        positions too), or ``None`` (all real). ``cache``: a ``KVCache`` from ``make_cache``
        holding ``offset`` positions; ``input_ids`` are then the next ``L`` tokens and the
        cache is extended by them. ``position_ids`` ``B x L`` overrides the positions.
        ``logits_to_keep=k > 0`` projects only the last ``k`` positions (generation: ``k = 1``).

        Hugging Face keywords (any of them, or ``return_dict=True``, returns a
        ``CausalLMOutput`` instead of the logits): ``labels`` ``B x L`` (the input ids,
        ``-100`` where no loss is wanted; shifted inside) gives ``.loss``, the next-token
        cross-entropy (``attnlab.models.outputs``); ``past_key_values`` is ``cache`` under
        Hugging Face's name; ``use_cache=True`` without one makes a cache that grows as
        tokens come (``KVCache(grow=True)``); either way ``.past_key_values`` is the cache,
        holding every position so far, to pass back with the next tokens.
        """
        c = self.config
        as_output = check_hf_keywords(
            labels=labels, use_cache=use_cache, past_key_values=past_key_values, cache=cache,
            return_dict=return_dict, logits_to_keep=logits_to_keep)
        cache = past_key_values if past_key_values is not None else cache
        if labels is not None or (use_cache and cache is None):
            B, L = check_token_ids("input_ids", input_ids, c.vocab_size)
            if labels is not None:
                check_labels(labels, (B, L), c.vocab_size)
            if use_cache and cache is None:
                cache = self.make_cache(B, L, grow=True)
        logits = self.lm_head(self.final_hidden(
            input_ids, attention_mask, cache=cache, position_ids=position_ids,
            logits_to_keep=logits_to_keep))
        if not as_output:
            return logits
        loss = None if labels is None else next_token_loss(logits, labels)
        return CausalLMOutput(logits=logits, loss=loss, past_key_values=cache)

    def final_hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                     cache: KVCache | None = None, position_ids: Tensor | None = None,
                     logits_to_keep: int = 0,
                     paged: list[LayerPages] | None = None) -> Tensor:
        """The last layer's output after the final norm, what ``lm_head`` turns into logits:
        input_ids ``B x L`` -> ``B x L x H`` (``B x min(k, L) x H`` for ``logits_to_keep=k >
        0``).

        The arguments are ``forward``'s. A caller that wants logits for only some rows (a
        serving engine's prefill chunk that does not end its prompt wants none) projects
        them itself, in one ``lm_head`` call for every row of a step. ``paged``: a serving
        step's pages, one ``LayerPages`` per layer (``attnlab.serving.runner`` builds them):
        input_ids ``1 x T`` are then its packed rows, placed and masked by their metadata
        (no ``attention_mask``, ``cache`` or ``position_ids``).
        """
        c = self.config
        if paged is not None:
            if cache is not None or attention_mask is not None or position_ids is not None \
                    or len(paged) != c.num_layers:
                raise ValueError(f"paged: expected {c.num_layers} layers' pages and no cache, "
                                 f"attention_mask or position_ids beside them, got "
                                 f"{len(paged)} layers")
            # The engine checked each request's tokens and length when it was added, and the
            # runner made the ids and positions from them: nothing to check again per token.
            # Its metadata masks each request; a mask for the packed rows is not used.
            L, offset, positions = input_ids.shape[1], 0, paged[0].metadata.positions[None]
            key_mask = mask = None
        else:
            _, L, offset, key_mask, positions = decoder_inputs(
                input_ids, attention_mask, cache, position_ids, logits_to_keep,
                vocab_size=c.vocab_size, max_len=c.max_len, num_layers=c.num_layers)
            # the plain causal case (no padding, no window) has no mask: known without a call
            mask = None if key_mask is None and c.sliding_window is None else decoder_mask(
                key_mask, L, offset, c.sliding_window, device=input_ids.device)
        x = self.embed_tokens(input_ids)
        if c.embedding_scale is not None:  # in x's dtype, as Gemma rounds it
            x = x * torch.tensor(c.embedding_scale, dtype=x.dtype)
        if self.embed_positions is not None:
            x = self.embed_positions(x, offset=positions)
        rotary = None
        if self.rotary is not None:
            if isinstance(positions, int):
                positions = torch.arange(positions, positions + L, device=input_ids.device)
            rotary = tuple(t.to(x.dtype) for t in self.rotary(positions))
        x = _dropped(self.drop, x)
        x = self.layers(x, rotary=rotary, mask=mask, is_causal=mask is None and L > 1,
                        cache=cache, rows=self._real_rows(key_mask, L, logits_to_keep),
                        paged=paged)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return self.norm(x)

    def _real_rows(self, key_mask: Tensor | None, L: int, keep: int) -> Tensor | None:
        """The flat ``B * L`` indices of the real (not padded) new positions, for the blocks
        to skip the padding in their row-wise MLP; None where every row runs: no padding, or
        at most an eighth of the rows padded (gathering would cost more than it saves), an
        output at a padded position (only the last ``keep > 0`` positions are returned, all
        of them real: a left-padded prompt's prefill), a gradient recorded, or a hook on any
        module of the blocks or on every module (a hook sees the tensors a plain call
        makes)."""
        if (key_mask is None or L == 1 or keep == 0 or torch.is_grad_enabled()
                or global_hooks() or any(m._forward_hooks or m._forward_pre_hooks
                                         for m in self.layers.modules())):
            return None
        new = key_mask[:, -L:]
        real = new.reshape(-1)
        padded = real.numel() - int(real.sum())  # host syncs: a prefill, once a forward
        if 8 * padded <= real.numel() or not bool(new[:, -keep:].all()):
            return None
        return real.nonzero().squeeze(1)

    def make_cache(self, batch_size: int, max_len: int | None = None, *,
                   grow: bool = False) -> KVCache:
        """An empty ``KVCache`` (``G`` heads per layer, ``max_len`` positions, model's dtype);
        ``grow=True``: ``max_len`` is the room allocated first, doubled when needed."""
        c = self.config
        return KVCache(c.num_layers, batch_size, c.kv_heads,
                       c.max_len if max_len is None else max_len, c.head_dim,
                       dtype=self.dtype, device=self.device, grow=grow)

    def cache_expires(self, length: int) -> bool:
        """Whether keys cached for ``length`` positions must be computed again before the next
        token: longrope RoPE turns to its long factors once the sequence passes
        ``original_max_position_embeddings``, and the keys cached with the short ones are then
        recomputed (as transformers' Phi-3 does); ``generate`` asks before each step."""
        scaling = self.config.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            return False
        return length == (scaling.original_max_position_embeddings or self.config.max_len)

    def generate(self, input_ids: Tensor, max_new_tokens: int | None = None,
                 **kwargs: Any) -> Tensor:
        """``attnlab.generation.generate(self, input_ids, max_new_tokens, **kwargs)``: the
        prompts ``B x P`` followed by the new tokens, ``B x (P + n)`` (greedy by default;
        ``do_sample``, ``attention_mask``, ``eos_token_id``, ... as documented there)."""
        return generate(self, input_ids, max_new_tokens, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, *,
                        kernels: bool = True, extra_memory: bool = False,
                        quantize: str | None = None, group_size: int | None = None,
                        skip: tuple[str, ...] | list[str] = (),
                        quantized_kernel: str | None = None) -> DecoderLM:
        """Load a checkpoint folder: attnlab's own format (``"attnlab_decoder"``) or a Hugging
        Face folder of any supported family (``attnlab.models.families``, picked by
        ``model_type``), in eval mode with trainable weights. ``dtype`` defaults to the
        stored one, ``device`` to the CPU.

        ``kernels`` (on the CPU): ``attnlab.kernels.optimize_for_inference``, which swaps in
        the fast inference modules: every ``nn.Linear`` becomes an
        ``attnlab.kernels.InferenceLinear`` that runs, without gradients, the kernel the rule
        names for its dtype, rows and this CPU (or a plan of ``attnlab calibrate``; same
        Parameters, same results within float rounding; ``ATTNLAB_KERNELS=formula`` forces the
        formula), and the norms, MLPs, attention layers and greedy choice their fast modules;
        ``extra_memory`` also allows oneDNN's packed copies of the weights.

        ``quantize`` (``"int8"`` or ``"int4"``, with ``group_size`` and ``skip`` as in
        ``quantize``) quantizes each weight as it is read, never holding the float model; a
        folder that ``save_pretrained`` wrote quantized loads as it was stored, without
        ``quantize`` or with the same scheme (another one is refused: re-quantizing quantized
        weights would compound their error). ``quantized_kernel`` forces one kernel on the
        quantized layers (``quantize``'s ``kernel``; ``"dequantize"``, the formula, times
        nothing).
        """
        if not isinstance(kernels, bool):
            raise TypeError(f"kernels: expected a bool, got {kernels!r}")
        file = gguf_file(path) if isinstance(path, (str, Path)) else None
        if file is not None:  # a GGUF file: its blocks kept as they are (attnlab.models.gguf)
            if quantize is not None:
                raise ValueError(f"quantize: {file} is a GGUF file, loaded as its blocks are "
                                 f"stored; got quantize={quantize!r}, expected None")
            model = load_gguf(cls, file, parse_dtype(dtype), parse_device(device))
        elif read_json(check_folder(path) / CONFIG_NAME).get("model_type") == cls.MODEL_TYPE:
            model = super().from_pretrained(path, dtype=dtype, device=device,
                                            quantize=quantize, group_size=group_size, skip=skip,
                                            quantized_kernel=quantized_kernel)
        else:
            model = load_family(cls, check_folder(path), parse_dtype(dtype), parse_device(device),
                                requested_quantization(quantize, group_size, skip),
                                kernel=quantized_kernel)
        if kernels and model.device.type == "cpu":
            install_kernels(model, extra_memory=extra_memory)
        return model

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors``: in the format of the model's
        Hugging Face family (``config.family``), or attnlab's own (``"model_type":
        "attnlab_decoder"``, our tensor names) when it has none or the model is quantized
        (no Hugging Face format holds our int8/int4 layouts; ``config.family`` is kept)."""
        if self.quantization is None and any(name.endswith("qweight")
                                             for name, _ in self.named_buffers()):
            # GGUF blocks (attnlab.models.gguf): a mix of int8/int4 groups and float that no
            # config.json scheme records, so a folder written now would not load back.
            raise ValueError("model: it holds the quantized blocks of a GGUF file, which no "
                             "checkpoint folder records; save the float model it came from")
        if self.config.family is None or self.quantization is not None:
            return super().save_pretrained(path)
        return save_family(self, path)

    def save_gguf(self, path: str | Path, *, type: str = "f16", tokenizer: Any = None) -> Path:
        """Write this model as the GGUF file ``path`` (llama.cpp's format: Ollama, llama.cpp
        and transformers' ``gguf_file=`` read it), its 2-d weights in ``type`` (``"f32"``,
        ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``), with ``tokenizer``'s
        vocabulary and chat template when given: ``attnlab.models.gguf_export.export_gguf``."""
        return export_gguf(self, path, type=type, tokenizer=tokenizer)

    def summary(self, max_depth: int = 2) -> str:
        """The per-module parameter counts as a table (``models.summary``); prints nothing."""
        return summary(self, max_depth=max_depth)


class DecoderBlock(nn.Module):
    """Pre-norm block: self-attention then MLP, each with a residual. ``B x L x E``.

    Hook points: ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``, ``resid_post``.
    """

    def __init__(self, config: DecoderLMConfig) -> None:
        super().__init__()
        c = config
        qk_norm = partial(RMSNorm, c.head_dim, eps=c.norm_eps,
                          unit_offset=c.norm == "rmsnorm_unit_offset") if c.qk_norm else None
        self.input_layernorm = make_norm(c, c.d_model)
        self.self_attn = SelfAttention(
            c.d_model, c.num_heads, c.kv_heads, c.head_dim,
            qkv_bias=c.resolved_bias("qkv_bias"), o_bias=c.resolved_bias("o_bias"),
            qk_norm=qk_norm, rope_interleaved=c.rope_traditional, scale=c.attention_scale,
            dropout=c.dropout, backend=c.backend)
        self.post_attention_layernorm = make_norm(c, c.d_model)
        mlp_bias = c.resolved_bias("mlp_bias")
        self.mlp = (GatedMLP(c.d_model, c.ff_dim, bias=mlp_bias, activation=GATED[c.mlp])
                    if c.mlp in GATED
                    else FeedForward(c.d_model, c.ff_dim, activation=c.mlp, bias=mlp_bias))
        self.drop = nn.Dropout(c.dropout)
        for point in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            setattr(self, point, HookPoint())

    def forward(self, x: Tensor, *, rotary: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None, is_causal: bool = True,
                cache: LayerKVCache | None = None, rows: Tensor | None = None,
                paged: LayerPages | None = None) -> Tensor:
        """x ``B x L x E``; ``rotary`` ``(cos, sin)``; ``mask`` ``B x 1 x L x S`` bool or
        ``None`` with ``is_causal``; ``cache`` this layer's ``LayerKVCache``; ``rows``: the
        flat ``B * L`` indices of the real positions, the only ones the MLP (row by row)
        then computes, a padded position's MLP output left zero (no real position reads it:
        the mask hides its key); ``paged``: this layer's pages of a serving step (then x is
        ``1 x T x E``, ``SelfAttention.forward``)."""
        x = self.resid_pre(x)
        h = self.self_attn(self.input_layernorm(x), rotary=rotary, mask=mask,
                           is_causal=is_causal, cache=cache, paged=paged)
        x = self.resid_mid(x + _dropped(self.drop, self.attn_out(h)))
        if rows is None:
            h = self.mlp(self.post_attention_layernorm(x))
        else:
            flat = x.reshape(-1, x.shape[-1])
            h = torch.zeros_like(flat).index_copy_(
                0, rows, self.mlp(self.post_attention_layernorm(flat.index_select(0, rows))))
            h = h.view_as(x)
        return self.resid_post(x + _dropped(self.drop, self.mlp_out(h)))


class DecoderLayers(nn.ModuleList):
    """The blocks in order: x ``B x L x E`` -> ``B x L x E``, block ``i`` with layer ``i`` of
    the cache. A ``ModuleList`` (``layers[i]``, ``state_dict`` names ``layers.{i}.``) that is
    also the one place the blocks are run, so a fast module can stand in for the loop."""

    # The class of the blocks this list runs: what a fast stand-in for the loop must compute.
    block_type: type[nn.Module] = DecoderBlock

    def forward(self, x: Tensor, *, rotary: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None, is_causal: bool = True,
                cache: KVCache | None = None, rows: Tensor | None = None,
                paged: list[LayerPages] | None = None) -> Tensor:
        """``DecoderBlock.forward``'s arguments, ``cache`` the whole ``KVCache``, ``paged``
        every layer's pages."""
        if paged is None:
            out = self.one_call_step(x, rotary, mask, cache)
            if out is not None:
                return out
        for i, layer in enumerate(self):
            x = layer(x, rotary=rotary, mask=mask, is_causal=is_causal,
                      cache=None if cache is None else cache[i], rows=rows,
                      paged=None if paged is None else paged[i])
        return x

    def one_call_step(self, x: Tensor, rotary: tuple[Tensor, Tensor] | None,
                      mask: Tensor | None, cache: KVCache | None) -> Tensor | None:
        """The whole of ``forward`` in one call, or None: the blocks run one by one (here,
        always). A fast stand-in for the list (``attnlab.kernels.FusedLayers``) runs a
        one-token step through every block in one C++ call; asked here, not by wrapping
        ``forward``, so that the step goes down into the kernels and never back up."""
        return None


def _dropped(drop: nn.Dropout, x: Tensor) -> Tensor:
    """``drop(x)``, skipped when its ``p`` is 0 (it is the identity then; the call costs
    microseconds on every step of decoding)."""
    return x if drop.p == 0 else drop(x)


def make_norm(c: DecoderLMConfig, dim: int) -> nn.Module:
    """The config's norm over ``dim`` features."""
    if c.norm == "layernorm":
        return nn.LayerNorm(dim, eps=c.norm_eps, bias=c.resolved_bias("norm_bias"))
    return RMSNorm(dim, eps=c.norm_eps, unit_offset=c.norm == "rmsnorm_unit_offset")

