"""Reading a GGUF file (llama.cpp's format: Ollama's and LM Studio's models) as a ``DecoderLM``,
its quantized blocks kept as they are.

A GGUF holds its config as metadata (``llama.block_count``, ``llama.embedding_length``, ...)
and its tensors under llama.cpp's names (``blk.0.attn_q.weight``), each in a block format.
The header is read by ``attnlab.models.gguf_reader`` (the block types, sizes and
dequantization are the ``gguf`` package's, llama.cpp's own), which maps the file: only the
tensor being placed is read, and its pages are released once it is repacked.

The blocks that attnlab's formats can hold keep their own numbers
(``attnlab.models.gguf_blocks``: Q8_0, Q5_0 and Q6_K as grouped int8, Q5_1 and Q5_K as grouped
int8 with offsets, Q4_0, Q4_1 and Q4_K as int4 groups of 32), each dequantizing to
``gguf.quants.dequantize``'s weight bit for bit in a float32 model (Q4_K within the bound that
module states where its zero is not exact in float32). A model loaded in another dtype
computes in it, with its scales and zeros rounded to it (bfloat16: a relative error of at most
2^-9 on each, float16: exact ``d``). A Q4_1 tensor whose zero is not exact in float32 is
dequantized instead (a notice says so). The model's dtype, unless asked, is bfloat16 for a
file of BF16 matrices and float32 for any other (``file_dtype``). F32, F16 and BF16 tensors
are converted to the model's dtype; every other type (Q2_K, Q3_K, ...) is dequantized by
``gguf`` to the model's dtype, with a one-line notice per type.

Architectures (``general.architecture``): llama (Mistral and SmolLM write it too), qwen2,
qwen3, gemma (its norms, which scale by ``1 + w``, stored as ``1 + w``), phi3 and gpt2,
each read by its family (``attnlab.models.families``) from a ``config.json``-like dict made
of the metadata. llama.cpp stores Llama's q and k rows
permuted (the two rotary halves of each head interleaved); they are put back in Hugging
Face's order, as transformers' GGUF loader does. Phi-3's and GPT-2's fused tensors
(``attn_qkv``, Phi-3's gate and up in ``ffn_up``) are split by rows, blocks kept.
A ``rope_freqs`` tensor (llama.cpp's Llama 3 RoPE scaling: each frequency divided by its
factor) becomes the config's RoPE scaling, as ``longrope`` with that one list of factors
(transformers' GGUF loader ignores the tensor). A file is refused, naming it, before anything
is allocated when its header's counts cannot fit in it or a tensor reaches past its end.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import gguf
import torch
from torch import Tensor, nn

from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families import Family, family_for
from attnlab.models.gguf_blocks import KEPT_TYPES, tensor_weight
from attnlab.models.gguf_reader import SHARD, GGUFFile, GGUFShards, first_shard
from attnlab.quantization.formats import QuantizedWeight
from attnlab.quantization.modules import QuantizedEmbedding, QuantizedLinear

__all__ = ["ARCHITECTURES", "CONFIG_KEYS", "FUSED", "GPT2_KEYS", "KEPT_TYPES", "LAYER_NAMES",
           "NAMES", "PERMUTED", "UNIT_OFFSET_NORMS", "config_dict", "config_from_gguf",
           "file_dtype", "gguf_file", "load_gguf", "open_gguf", "our_names", "row_order",
           "tensor_weight"]

MAGIC = b"GGUF"
Q = gguf.GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
BLOCK = 32  # inputs per block of Q8_0, Q4_0, Q4_1 (what the exporter writes)
# GGUF general.architecture -> the family's model_type (Mistral and SmolLM write "llama").
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                 "phi3": "phi3", "gpt2": "gpt2"}
PERMUTED = ("llama",)  # architectures whose q/k rows llama.cpp interleaves
UNIT_OFFSET_NORMS = ("gemma",)  # norms scaling by 1 + w, which llama.cpp stores as 1 + w
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3's scaling)
_MAX_FACTORS = 2**15  # rope_freqs read before the config: a bound far above any head

# llama.cpp's names -> ours: whole-model tensors, then those of block {}.
NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
          "output_norm.bias": "norm.bias", "output.weight": "lm_head.weight",
          "position_embd.weight": "embed_positions.weight"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv"
       for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# An architecture's own block tensors, over LAYER_NAMES: several names for a fused tensor
# (rows stacked in that order: q, k and v in one, gate and up in one).
_QKV = {f"attn_qkv.{kind}": tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv")
        for kind in ("weight", "bias")}
_GPT2 = {f"{theirs}.{kind}": (f"{ours}.{kind}",) for kind in ("weight", "bias")
         for theirs, ours in (("attn_norm", "input_layernorm"),
                              ("ffn_norm", "post_attention_layernorm"),
                              ("attn_output", "self_attn.o_proj"), ("ffn_up", "mlp.linear1"),
                              ("ffn_down", "mlp.linear2"))}
FUSED = {"phi3": {**_QKV, "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
          "gpt2": {**_QKV, **_GPT2}}
# GGUF metadata key (after "<arch>.") -> config.json key; GPT-2 has its own names.
CONFIG_KEYS = {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
                "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
GPT2_KEYS = {"block_count": "n_layer", "context_length": "n_positions",
              "embedding_length": "n_embd", "feed_forward_length": "n_inner",
              "attention.head_count": "n_head",
              "attention.layer_norm_epsilon": "layer_norm_epsilon", "vocab_size": "vocab_size"}


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file that ``path`` names: itself when it starts with the GGUF magic (any
    name: an Ollama blob has no extension), or the one ``*.gguf`` file of a folder without a
    ``config.json``; the first shard for a model split into shards (any shard's name, or a
    folder holding the set); None otherwise (a checkpoint folder, a missing path). A folder
    with several ``*.gguf`` files that are not one set of shards is refused naming them."""
    path = Path(path)
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != MAGIC:
                return None
        first = first_shard(path)
        return first if first is not None and first.is_file() else path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    firsts = {first_shard(f) for f in found}
    if len(found) > 1 and (len(firsts) > 1 or None in firsts):
        raise ValueError(f"path: {path} holds {len(found)} GGUF files "
                         f"({', '.join(f.name for f in found)}); name the one to load")
    return found[0] if found else None


def open_gguf(file: Path) -> GGUFFile | GGUFShards:
    """``file``'s header read and checked (``attnlab.models.gguf_reader.GGUFFile``: counts
    that cannot fit in the file, a tensor that reaches past its end, a truncated header are
    each a ``ValueError`` naming the file); its tensors mapped, none read. The first shard of
    a split model opens every shard (``GGUFShards``)."""
    if SHARD.match(file.name) and first_shard(file) == file:
        return GGUFShards(file)
    return GGUFFile(file)


def config_from_gguf(reader: GGUFFile | GGUFShards, file: Path
                     ) -> tuple[Family, DecoderLMConfig]:
    """``(family, config)`` from the file's metadata, read as the family reads a
    ``config.json`` (so its checks and defaults apply); errors name ``file`` and the key."""
    d = config_dict(reader.fields, [t.name for t in reader.tensors], file)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if math.prod(freqs.shape) > _MAX_FACTORS:
            raise ValueError(f"{file}: {ROPE_FREQS} has {math.prod(freqs.shape)} factors, "
                             f"more than a rotary head's {_MAX_FACTORS} at most")
        # llama.cpp divides each rotary frequency by its factor: longrope's computation with
        # one factor list at every length and no attention factor.
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1).tolist()
        d["rope_parameters"] = {"rope_type": "longrope", "short_factor": factors,
                                "long_factor": factors, "factor": 1.0,
                                "rope_theta": d.get("rope_theta", 10000.0)}
    family = family_for(d["model_type"])
    try:
        config = family.config_from_hf(d)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{file}: {error} (read from the GGUF metadata "
                          f"{d['model_type']}.*)") from None
    if freqs is not None and 2 * math.prod(freqs.shape) != config.rotary_size:
        raise ValueError(f"{file}: {ROPE_FREQS} has {math.prod(freqs.shape)} factors; the "
                         f"model rotates {config.rotary_size} features, expected "
                         f"{config.rotary_size // 2}")
    return family, config


def config_dict(fields: dict[str, Any], names: list[str], file: Path | str) -> dict[str, Any]:
    """The ``config.json``-like dict that the metadata ``fields`` and the tensor ``names`` of
    a GGUF file describe (what ``config_from_gguf`` reads; ``attnlab.models.gguf_export``
    checks with it that a file it writes reads back as the same model)."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: general.architecture {arch!r} is not supported; expected "
                         f"one of {sorted(ARCHITECTURES)}")
    keys = GPT2_KEYS if arch == "gpt2" else CONFIG_KEYS
    d: dict[str, Any] = {"model_type": ARCHITECTURES[arch]}
    for key, hf in keys.items():
        value = fields.get(f"{arch}.{key}")
        if value is not None:
            d[hf] = value
    if "vocab_size" not in d:  # older files: the vocabulary's length
        tokens = fields.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            d["vocab_size"] = len(tokens)
    d["tie_word_embeddings"] = "output.weight" not in names
    if arch != "gpt2":
        d["attention_bias"] = "blk.0.attn_q.bias" in names
    for role in ("bos", "eos"):
        value = fields.get(f"tokenizer.ggml.{role}_token_id")
        if value is not None:
            d[f"{role}_token_id"] = value
    return d


def load_gguf(cls: type[nn.Module], file: Path, dtype: torch.dtype | None,
              device: torch.device) -> nn.Module:
    """``cls(config)`` (a ``DecoderLM``) with the weights of the GGUF ``file`` in eval mode:
    Q8_0/Q4_0/Q4_1 linear layers and embeddings as quantized modules holding the blocks'
    numbers, the rest in ``dtype`` (default ``file_dtype``) on ``device`` (module
    docstring)."""
    reader = open_gguf(file)
    family, config = config_from_gguf(reader, file)
    dtype = dtype or file_dtype(reader)
    _check_sizes(reader, config, file)
    try:
        with torch.device("meta"):  # shapes without memory, checked against the file below
            model = cls(config)  # type: ignore[call-arg]
    except (RuntimeError, OverflowError) as error:  # a size past torch's int64
        raise ValueError(f"{file}: sizes too large to build a model ({error})") from None
    targets = model.state_dict(keep_vars=True)
    arch = _field(reader, "general.architecture")
    tensors: dict[tuple[str, ...], Any] = {}  # our names (a fused tensor: its parts) -> it
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # read into the config's RoPE scaling
            continue
        parts = our_names(t.name, arch)
        if parts is None or any(p not in targets for p in parts):
            raise ValueError(f"{file}: unexpected tensor {t.name!r}: no weight of a "
                             f"{family.name} model of this config is stored under that name")
        shape, want = tuple(reversed(t.shape)), _fused_shape(targets, parts)
        if shape != want:
            raise ValueError(f"{file}: tensor {t.name!r} has shape {shape}; the metadata "
                             f"implies {want}")
        tensors[parts] = t
    placed = {p for parts in tensors for p in parts}
    missing = [n for n in targets if n not in placed
               and not (n == "lm_head.weight" and config.tie_embeddings)]
    if missing:
        raise ValueError(f"{file}: tensors missing for {missing[:4]}")
    print(f"attnlab: loading {config.num_layers} layers from {file} ...", file=sys.stderr,
          flush=True)
    notices: dict[str, int] = {}
    for parts, t in tensors.items():
        rows = row_order(parts[0], config) if arch in PERMUTED else None
        sizes = [targets[p].shape[0] for p in parts]
        # Gemma's norms scale by 1 + w; llama.cpp stores 1 + w, transformers w.
        offset = 1.0 if arch in UNIT_OFFSET_NORMS and t.name.endswith("norm.weight") else 0.0
        _place(model, parts, sizes, t, rows, dtype, device, notices, config.tie_embeddings,
               offset)
        reader.release(t)
    for kind, count in notices.items():
        print(f"attnlab: {file.name}: {count} {kind} tensors dequantized to "
              f"{str(dtype).removeprefix('torch.')} (no attnlab format holds them)",
              file=sys.stderr)
    reader.close()
    model = model.to(device).eval()
    if device.type == "cpu":  # kernels chosen now, so that print(model) shows them
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                module.plan(dtype)
    return model


def file_dtype(reader: GGUFFile | GGUFShards) -> torch.dtype:
    """The dtype a GGUF loads in when none is asked: bfloat16 for a file whose matrices (2-d
    tensors) are all BF16, as a Hugging Face folder loads in its stored ``torch_dtype``;
    float32 otherwise (F32 and F16 files: float16 has no fast CPU kernel here; quantized
    blocks: their scales in float32 keep ``gguf``'s dequantization bit for bit)."""
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    if matrices and all(Q(t.tensor_type) == Q.BF16 for t in matrices):
        return torch.bfloat16
    return torch.float32


def _check_sizes(reader: GGUFFile | GGUFShards, config: DecoderLMConfig, file: Path) -> None:
    """Refuse, before a model is built, metadata asking for more layers than the file has
    tensors or a size above the number of values its tensors hold (a hostile header would
    otherwise make Python build a billion modules)."""
    if config.num_layers > len(reader.tensors):
        raise ValueError(f"{file}: block_count {config.num_layers} is more than the "
                         f"{len(reader.tensors)} tensors the file holds")
    held = sum(math.prod(t.shape) for t in reader.tensors)
    for name in ("vocab_size", "d_model", "num_heads", "kv_heads", "head_dim", "ff_dim"):
        if getattr(config, name) > held:
            raise ValueError(f"{file}: {name} {getattr(config, name)} is more than the {held} "
                             "values its tensors hold; the metadata does not match them")


def _place(model: nn.Module, parts: tuple[str, ...], sizes: list[int], t: Any,
           rows: Tensor | None, dtype: torch.dtype, device: torch.device,
           notices: dict[str, int], tied: bool, offset: float = 0.0) -> None:
    """Read the GGUF tensor ``t`` (minus ``offset``) and make it the model's ``parts`` (a
    fused tensor split by rows into pieces of ``sizes``; in ``rows`` order when given):
    quantized modules for a kept block type, else float parameters."""
    kind = Q(t.tensor_type)
    owners = [p.rpartition(".") for p in parts]
    modules = [model.get_submodule(owner) for owner, _, _ in owners]
    if kind in KEPT_TYPES and all(leaf == "weight" for _, _, leaf in owners) and all(
            isinstance(m, (nn.Linear, nn.Embedding)) for m in modules):
        try:
            weight = tensor_weight(t)
        except ValueError:  # a Q4_1 zero not exact in float32: dequantized below
            weight = None
        if weight is not None:
            if rows is not None:
                weight = _rows(weight, rows)
            if dtype != torch.float32:  # the modules compute in their scales' dtype
                weight = QuantizedWeight(weight.bits, weight.data, weight.scales.to(dtype),
                                         None if weight.zeros is None
                                         else weight.zeros.to(dtype))
            start = 0
            for (owner, _, _), module, size in zip(owners, modules, sizes):
                piece = _rows(weight, slice(start, start + size)) if len(parts) > 1 else weight
                _swap_quantized(model, owner, module, piece, tied)
                start += size
            return
    if kind not in FLOAT_TYPES:
        notices[kind.name] = notices.get(kind.name, 0) + 1
    values = gguf.quants.dequantize(t.data, kind)  # F32: a view of the mapped file
    values = torch.from_numpy(values if values.flags.writeable else values.copy())
    value = values.reshape(tuple(reversed(t.shape)))
    value = value if rows is None else value[rows]
    value = (value - offset if offset else value).to(device=device, dtype=dtype)
    for (owner, _, leaf), module, piece in zip(owners, modules, value.split(sizes)):
        parameter = nn.Parameter(piece if len(parts) == 1 else piece.clone())
        setattr(module, leaf, parameter)
        if f"{owner}.{leaf}" == "embed_tokens.weight" and tied and isinstance(
                model.lm_head, nn.Linear):
            model.lm_head.weight = parameter


def _rows(weight: QuantizedWeight, index: Tensor | slice) -> QuantizedWeight:
    """The rows ``index`` of ``weight`` (each row's blocks are its own)."""
    return QuantizedWeight(weight.bits, weight.data[index], weight.scales[index],
                           None if weight.zeros is None else weight.zeros[index])


def _fused_shape(targets: dict[str, Tensor], parts: tuple[str, ...]) -> tuple[int, ...]:
    """The shape of the stored tensor holding ``parts`` stacked by rows."""
    first = tuple(targets[parts[0]].shape)
    return (sum(targets[p].shape[0] for p in parts), *first[1:])


def _swap_quantized(model: nn.Module, name: str, module: nn.Module, weight: QuantizedWeight,
                    tied: bool) -> None:
    """Put a quantized module holding ``weight`` in place of ``module`` (``name``); a tied
    embedding's table becomes the LM head's, which the embedding then reads."""
    parent, _, child = name.rpartition(".")
    rows, cols = weight.shape
    if isinstance(module, nn.Linear):
        # scale_dtype: the model's dtype (the scales were cast to it), which the module
        # then reports and computes its formula in
        new = QuantizedLinear(cols, rows, module.bias is not None, bits=weight.bits,
                              group_size=weight.group_size, scale_dtype=weight.scales.dtype,
                              device="meta")
        if module.bias is not None:
            new.bias = module.bias  # placed when its own tensor is read
        new.set_weight(weight)
        model.get_submodule(parent)._modules[child] = new
        return
    head = QuantizedLinear(cols, rows, False, bits=weight.bits, group_size=weight.group_size,
                           scale_dtype=weight.scales.dtype, device="meta")
    head.set_weight(weight)
    if tied:
        model.lm_head = head
        model.embed_tokens = QuantizedEmbedding.tied_to(head)
        return
    embedding = QuantizedEmbedding(rows, cols, bits=weight.bits,
                                   group_size=weight.group_size,
                                   scale_dtype=weight.scales.dtype, device="meta")
    embedding.table.set_weight(weight)
    model.get_submodule(parent)._modules[child] = embedding


def row_order(ours: str, config: DecoderLMConfig) -> Tensor | None:
    """The rows of llama.cpp's q/k weight (or bias) in Hugging Face's order: per head, the
    interleaved pairs ``(2i, 2i + 1)`` back to the halves ``(i, i + D/2)``."""
    if ".self_attn.q_proj." in ours:
        heads = config.num_heads
    elif ".self_attn.k_proj." in ours:
        heads = config.kv_heads
    else:
        return None
    return torch.arange(heads * config.head_dim).view(heads, -1, 2).transpose(1, 2).reshape(-1)


def our_names(name: str, arch: str) -> tuple[str, ...] | None:
    """llama.cpp's tensor name -> ours, several for a fused tensor (rows stacked in that
    order), or None for a name no family here stores."""
    if name in NAMES:
        return (NAMES[name],)
    head, _, rest = name.partition(".")
    index, _, leaf = rest.partition(".")
    fused = FUSED.get(arch, {})
    if head != "blk" or not index.isdigit() or (leaf not in LAYER_NAMES and leaf not in fused):
        return None
    ours = fused[leaf] if leaf in fused else (LAYER_NAMES[leaf],)
    return tuple(f"layers.{int(index)}.{name}" for name in ours)


def _field(reader: GGUFFile | GGUFShards, key: str) -> Any:
    """The metadata value ``key``, or None when absent."""
    return reader.fields.get(key)
