"""Tiny GGUF files for the GGUF tests, written with the ``gguf`` package's own writer as
llama.cpp's converter writes them: a random transformers model's tensors under llama.cpp's
names (Llama's q/k rows interleaved), quantized by ``gguf.quants``, with a byte-level BPE
tokenizer and a chat template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers as tf
from tokenizers import (
    SentencePieceBPETokenizer,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)
from torch import nn

Q = gguf.GGMLQuantizationType
TEXT = ("The quick brown fox jumps over the lazy dog. Attention is all you need; "
        "transformers read text as tokens, 1234 5678, and write it back! ") * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
          "self_attn.o_proj.weight": "attn_output.weight",
          **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
          "self_attn.qkv_proj.weight": "attn_qkv.weight",
          "mlp.gate_up_proj.weight": "ffn_up.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight"}


def bpe_vocabulary() -> tuple[list[str], list[str]]:
    """``(tokens, merges)`` of a byte-level BPE trained on ``TEXT``, the specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in merges]


def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, types)`` of a SentencePiece BPE trained on ``TEXT`` as llama.cpp
    writes one: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0xNN>``, then the pieces,
    each scored minus its rank (a merged piece after its parts)."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([TEXT], vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                           show_progress=False)
    vocab = sp.get_vocab()
    pieces = [p for p in sorted(vocab, key=vocab.__getitem__) if p not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return tokens, scores, types


# K-quant blocks (256 inputs): their bytes, and where their half-precision scales sit.
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
             Q.Q6_K: (208,)}


def write_gguf(path: Path, model: nn.Module, arch: str, qtype: Q, *,
               tokens: list[str], merges: list[str] | None, pre: str | None = "qwen2",
               tokenizer_model: str = "gpt2", split_max_tensors: int = 0,
               scores: list[float] | None = None, types: list[int] | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """``model`` (a transformers Llama/Qwen2/Qwen3) as the GGUF ``path``: 2-d weights in
    ``qtype``, norms and biases in F32. ``gguf`` cannot quantize to the K-quants: for those,
    each 2-d weight is random blocks of that type (finite scales), not the model's weight.
    ``scores``/``types`` (a SentencePiece vocabulary, ``merges`` None): written instead of the
    merges and of the types made from ``SPECIALS``; ``pre`` None writes no pre-tokenizer
    name. ``extra``: more tensors, written as they are, first. ``split_max_tensors``: shards
    ``STEM-0000i-of-0000N.gguf`` of at most that many tensors (the first one's path
    returned)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny")
    if arch == "gpt2":
        w.add_block_count(c.n_layer)
        w.add_context_length(c.n_positions)
        w.add_embedding_length(c.n_embd)
        w.add_feed_forward_length(4 * c.n_embd)
        w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    else:
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types or [3 if t in SPECIALS else 1 for t in tokens])
    if scores is not None:
        w.add_token_scores(scores)
        w.add_unk_token_id(tokens.index("<unk>"))
        w.add_bos_token_id(tokens.index("<s>"))
        w.add_eos_token_id(tokens.index("</s>"))
    else:
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(TEMPLATE)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp stores a tied table once, as token_embd
        ours = gpt2_name(name) if arch == "gpt2" else gguf_name(name)
        if ours is None:
            continue
        a = t.detach().float().numpy()
        if arch == "gpt2" and a.ndim == 2 and ".attn_norm" not in ours and name.startswith(
                "transformer.h."):
            a = np.ascontiguousarray(a.T)  # Conv1D stores in x out; GGUF out x in
        if arch == "llama" and ours.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in ours else c.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2)
            a = a.reshape(t.shape)
        if a.ndim == 2 and qtype in _K_SCALES:
            w.add_tensor(ours, random_blocks(a.shape, qtype), raw_dtype=qtype)
        elif a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(ours, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(ours, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]


def random_blocks(shape: tuple[int, int], qtype: Q, seed: int = 0) -> np.ndarray:
    """Random bytes of ``qtype`` blocks for an ``O x I`` weight, every block's half-precision
    scale(s) set to small random values (random bytes could be NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        scale = (rng.random((rows, cols // block)) * 2e-3).astype(np.float16)
        data[..., at:at + 2] = scale[..., None].view(np.uint8)
    return data.reshape(rows, -1)


_GPT2 = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv",
         "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GPT2_TOP = {"transformer.wte.weight": "token_embd.weight",
             "transformer.wpe.weight": "position_embd.weight",
             "transformer.ln_f.weight": "output_norm.weight",
             "transformer.ln_f.bias": "output_norm.bias", "lm_head.weight": "output.weight"}


def gpt2_name(hf: str) -> str | None:
    """transformers' GPT-2 name -> llama.cpp's (None: a causal-mask buffer, not stored)."""
    if hf in _GPT2_TOP:
        return _GPT2_TOP[hf]
    index, _, rest = hf.removeprefix("transformer.h.").partition(".")
    stem, _, kind = rest.rpartition(".")
    return f"blk.{index}.{_GPT2[stem]}.{kind}" if stem in _GPT2 else None


def gguf_name(hf: str) -> str:
    """transformers' tensor name -> llama.cpp's."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, index_leaf = hf.partition("model.layers.")
    index, _, leaf = index_leaf.partition(".")
    return f"blk.{index}.{_LAYER[leaf]}"


def tiny_model(arch: str, vocab: int, *, tied: bool = True, seed: int = 0,
               width: int = 64) -> nn.Module:
    """A random transformers model of ``arch`` (``width`` wide, four heads), norms and biases
    moved off their initial values, in eval mode."""
    if arch == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=2, n_head=4,
                               n_positions=1024, tie_word_embeddings=tied)  # transformers
        # reads context_length as n_ctx and keeps n_positions at its default, 1024
        return _perturbed(tf.GPT2LMHeadModel, config, seed)
    cls, config_cls = {"llama": (tf.LlamaForCausalLM, tf.LlamaConfig),
                       "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config),
                       "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config),
                       "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config),
                       "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig)}[arch]
    extra = {"pad_token_id": None} if arch == "phi3" else {}
    config = config_cls(vocab_size=vocab, hidden_size=width,
                        intermediate_size=96 if width == 64 else width, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        # transformers' GGUF loader takes Qwen3's head_dim from its default
                        # (128), not from the file's attention.key_length
                        head_dim=128 if arch == "qwen3" else width // 4,
                        max_position_embeddings=256, tie_word_embeddings=tied,
                        rms_norm_eps=1e-6, **extra)
    return _perturbed(cls, config, seed)


def _perturbed(cls: type, config: object, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make(tmp_path: Path, vocabulary: tuple, arch: str, qtype: gguf.GGMLQuantizationType, *,
         tied: bool = True, width: int = 64) -> tuple[Path, nn.Module]:
    """``(file, theirs)``: a tiny ``arch`` model written as ``tmp_path / "tiny.gguf"`` in
    ``qtype`` (``write_gguf``) and transformers' model read back from that file."""
    tokens, merges = vocabulary
    hf_model = tiny_model(arch, len(tokens), tied=tied, width=width)
    file = write_gguf(tmp_path / "tiny.gguf", hf_model, arch, qtype, tokens=tokens,
                      merges=merges)
    theirs = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                     dtype=torch.float32).eval()
    return file, theirs
