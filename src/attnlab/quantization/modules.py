"""``QuantizedLinear`` and ``QuantizedEmbedding``: ``nn.Linear`` / ``nn.Embedding`` with an
int8 or int4 weight (``attnlab.quantization.formats``), swapped in for the float modules.

The codes and scales are buffers (``qweight``, ``scales``, int4 ``zeros``, and coded int4
scales' ``steps``): they move with
``.to()``, are saved in ``state_dict`` in the plain layout whatever the module keeps, and
receive no gradient (a bias stays a trainable Parameter; the input gets its gradient through
the formula). A tied LM head and its embedding share one quantized table: the embedding reads
the head's buffers, and a lookup dequantizes only the rows it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from attnlab.allocator import return_free_pages
from attnlab.kernels import bucket_of, native
from attnlab.kernels.catalog import Kernel
from attnlab.quantization.formats import (
    STEP_ROWS,
    QuantizedWeight,
    pack_int4,
    quantize,
    unblocked_int4,
)
from attnlab.quantization.kernels import QUANTIZED_KERNELS, step_product
from attnlab.quantization.kernels import plan as kernel_plan

__all__ = ["QuantizedEmbedding", "QuantizedLinear"]

_SAME_WIDTH = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
               torch.float32: torch.int32}


class QuantizedLinear(nn.Module):
    """``y = x W'^T + b`` (x ``N.. x I`` -> ``N.. x O``) with ``W'`` an int8 (per output row)
    or int4 (groups of ``group_size`` inputs) weight. Without gradients, on the CPU, each call
    runs the kernel chosen for its activation dtype and row count by the rule, or by the plan
    that ``attnlab calibrate`` measured here (:mod:`attnlab.quantization.kernels`); otherwise,
    and as the reference, the formula ``linear(x, dequantize(W'), b)``. ``scale_dtype``
    ``torch.int8`` (int4 only) keeps coded scales (``attnlab.quantization.formats``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 8,
                 group_size: int = 64, scale_dtype: torch.dtype = torch.float32,
                 bias_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, kernel: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The activations' dtype: the bias's (int4's float16 scales serve float32 and
        # bfloat16 models alike); ``_apply`` keeps it with ``.to(dtype)``.
        coded = scale_dtype == torch.int8
        if coded and bits != 4:
            raise ValueError(f"scale_dtype: int8 (coded scales) is int4's, got bits={bits!r}")
        self.dtype = bias_dtype or (torch.float32 if coded else scale_dtype)
        self.bits, self.group_size = bits, (in_features if bits == 8 else group_size)
        self.layout, self._kernel = "plain", kernel
        rows, cols = out_features, in_features
        if bits == 8:
            data, scales = torch.empty(rows, cols, dtype=torch.int8, device=device), (rows,)
        else:
            data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
            scales = (rows, cols // group_size)
        self.register_buffer("qweight", data)
        self.register_buffer("scales", torch.empty(
            scales, dtype=torch.uint8 if coded else scale_dtype, device=device))
        # torch.empty, not empty_like: empty_like of a meta tensor imports sympy (~20 MiB)
        self.register_buffer("zeros", None if bits == 8 else torch.empty(
            scales, dtype=scale_dtype, device=device))
        self.register_buffer("steps", torch.empty(
            -(-rows // STEP_ROWS), 2, dtype=torch.bfloat16, device=device) if coded else None)
        empty = torch.empty(rows, dtype=self.dtype, device=device)
        self.bias = nn.Parameter(empty) if bias else None
        self._plans: dict[torch.dtype, dict[str, Kernel]] = {}
        self._states: dict[tuple, tuple] = {}

    @classmethod
    def from_linear(cls, module: nn.Linear, *, bits: int, group_size: int = 64,
                    kernel: str | None = None, fit: str = "nearest",
                    scale_dtype: torch.dtype | None = None) -> QuantizedLinear:
        """``module`` quantized (scales in ``scale_dtype``, default its weight's dtype; its
        bias kept; int4's chosen by ``fit``, ``formats.quantize``'s), its kernels chosen now
        for the weight's dtype when it lives on the CPU; ``kernel`` forces one kernel."""
        weight = _quantized_by_rows(module.weight, bits, group_size, fit, scale_dtype)
        return cls.from_weight(weight, module.bias, kernel=kernel, dtype=module.weight.dtype)

    @classmethod
    def from_weight(cls, weight: QuantizedWeight, bias: Tensor | None = None, *,
                    kernel: str | None = None, dtype: torch.dtype | None = None
                    ) -> QuantizedLinear:
        """A module keeping ``weight`` (computed elsewhere: GPTQ's codes) and a copy of
        ``bias`` (``O`` or None, trainable when it was), its kernels chosen now for
        activations in ``dtype`` (default the scales') when it lives on the CPU; ``kernel``
        forces one kernel."""
        rows, cols = weight.shape
        scale_dtype = torch.int8 if weight.coded else weight.scales.dtype
        new = cls(cols, rows, bias is not None, bits=weight.bits, group_size=weight.group_size,
                  scale_dtype=scale_dtype, device="meta", kernel=kernel)
        new.set_weight(weight)
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        new.dtype = dtype or (bias.dtype if bias is not None else new.dtype)
        if weight.scales.device.type == "cpu":
            new.plan(new.dtype)
        return new

    @property
    def weight_format(self) -> QuantizedWeight:
        """The quantized weight as stored (codes in ``self.layout``)."""
        return QuantizedWeight(self.bits, self.qweight, self.scales, self.zeros, self.layout,
                               self.steps)

    def set_weight(self, weight: QuantizedWeight) -> None:
        """Keep ``weight`` (same bits and shape; its own group size, a grouped int8 one's
        too) as this module's buffers, in its layout."""
        self.qweight, self.scales, self.zeros = weight.data, weight.scales, weight.zeros
        self.steps, self.layout, self.group_size = weight.steps, weight.layout, weight.group_size
        self._plans.clear()
        self._states.clear()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantizedLinear:
        """``nn.Module._apply``, ``self.dtype`` following what ``fn`` makes of a float; coded
        scales' ``steps`` keep their dtype (moved, never cast: they are part of the codes)."""
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        steps = self._buffers.get("steps")
        if steps is not None:  # seen as integers of its width, which no dtype cast touches
            self._buffers["steps"] = steps.view(_SAME_WIDTH[steps.dtype])
        try:
            return super()._apply(fn, recurse)
        finally:
            if steps is not None:
                self._buffers["steps"] = self._buffers["steps"].view(steps.dtype)

    def plan(self, dtype: torch.dtype) -> dict[str, Kernel]:
        """The kernel per rows bucket for activations in ``dtype`` (the rule's, or a measured
        plan from the cache; nothing is timed); the first plan may re-store int4 codes in the
        other layout when the kernels chosen read it (a plan keeps to one layout)."""
        picks = kernel_plan(self.weight_format, dtype, kernel=self._kernel,
                            bias=self.bias is not None)
        needed = {QUANTIZED_KERNELS[n].layout for n in picks.values()} - {None}
        if needed and needed != {self.layout} and not self._plans:  # decided once, then kept
            self.set_weight(self.weight_format.with_layout(needed.pop()))
        picks = {b: n if QUANTIZED_KERNELS[n].layout in (None, self.layout) else "dequantize"
                 for b, n in picks.items()}
        kernels = {b: QUANTIZED_KERNELS[n] for b, n in picks.items()}
        self._plans[dtype] = kernels
        return kernels

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``W'`` (``O x I``) in ``dtype`` (default ``self.dtype``, the activations')."""
        return self.weight_format.dequantize(dtype or self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x ``N.. x I`` -> ``N.. x O`` in x's dtype (see the class docstring)."""
        if (x.dim() == 0 or x.shape[-1] != self.in_features or not x.is_floating_point()):
            raise ValueError(f"x: expected a floating-point tensor whose last dim is "
                             f"{self.in_features} (in_features), got {x.dtype} of shape "
                             f"{tuple(x.shape)}")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if (x.numel() == 0 or not (x.is_cpu and self.qweight.is_cpu) or (torch.is_grad_enabled()
                and (x.requires_grad or (bias is not None and bias.requires_grad)))):
            return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)
        flat = x.reshape(-1, self.in_features).contiguous()
        kernel, state = self._planned(flat.shape[0], x.dtype)
        return kernel.run(flat, state, bias).view(*x.shape[:-1], self.out_features)

    def native_spec(self, rows: int, dtype: torch.dtype) -> object | None:
        """What ``forward`` runs for ``rows`` rows of ``dtype`` activations on the CPU with no
        gradient, as a product of ``attnlab.kernels.native.step_plan`` (``native.step_linear``:
        the planned kernel on its prepared codes, scales and zeros, the bias in ``dtype``);
        None off the CPU or for a kernel that the step does not run (attnlab's C++ GEMVs and
        PyTorch's packed ops it does)."""
        # _buffers directly: nn.Module's __getattr__ costs ~0.6 us a name.
        if not self._buffers["qweight"].is_cpu:
            return None
        kernel, state = self._planned(rows, dtype)
        return step_product(kernel, state, None if self.bias is None else self.bias.to(dtype))

    def _planned(self, rows: int, dtype: torch.dtype) -> tuple[Kernel, tuple]:
        """The planned kernel for ``rows`` rows of ``dtype`` and its prepared state (made once
        per kernel, dtype and weight storage)."""
        kernels = self._plans.get(dtype) or self.plan(dtype)
        kernel = kernels[bucket_of(rows)]
        buffers = self._buffers
        key = (kernel.name, dtype, buffers["qweight"].data_ptr(), buffers["scales"].data_ptr())
        state = self._states.get(key)
        if state is None:
            self._states = {k: v for k, v in self._states.items() if k[0] != kernel.name}
            state = self._states[key] = kernel.prepare(self.weight_format, dtype)
        return kernel, state

    def extra_repr(self) -> str:
        scheme = (f"int{self.bits}" + ("" if self.group_size == self.in_features
                                        and self.bits == 8 else f", group_size={self.group_size}")
                  + (", offsets" if self.bits == 8 and self.zeros is not None else "")
                  + (", coded scales" if self.steps is not None else ""))
        plans = "; ".join(f"{str(d).removeprefix('torch.')}: "
                          + " ".join(f"{b}={k.name}" for b, k in p.items())
                          for d, p in self._plans.items())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {scheme}, layout={self.layout}"
                + (f", kernels=({plans})" if plans else ""))

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.layout == "blocked":  # written in the plain layout, whatever is kept
            destination[prefix + "qweight"] = pack_int4(unblocked_int4(self.qweight))

    def _load_from_state_dict(self, state_dict: Mapping, prefix: str, *args) -> None:
        key = prefix + "qweight"
        if self.layout == "blocked" and key in state_dict:
            loaded = QuantizedWeight(4, state_dict[key], self.scales, self.zeros,
                                     steps=self.steps)
            state_dict = {**state_dict, key: loaded.with_layout("blocked").data}
        self._states.clear()
        super()._load_from_state_dict(state_dict, prefix, *args)


class QuantizedEmbedding(nn.Module):
    """``E'[ids]`` (ids ``N..`` -> ``N.. x D``) from an int8/int4 table ``E'`` (``V x D``),
    dequantizing only the rows looked up, in the scales' dtype. Either its own table or, for
    a tied LM head, the head's (``tied_to``), read through the head so both stay one."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int = 8,
                 group_size: int = 64, scale_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.table = QuantizedLinear(embedding_dim, num_embeddings, bias=False, bits=bits,
                                     group_size=group_size, scale_dtype=scale_dtype,
                                     device=device)

    @classmethod
    def from_embedding(cls, module: nn.Embedding, *, bits: int, group_size: int = 64,
                       fit: str = "nearest") -> QuantizedEmbedding:
        """``module`` quantized, its rows in groups of ``group_size`` along ``D`` for int4
        (scales and zeros chosen by ``fit``)."""
        w = module.weight
        new = cls(module.num_embeddings, module.embedding_dim, bits=bits, group_size=group_size,
                  scale_dtype=w.dtype, device="meta")
        new.table.set_weight(_quantized_by_rows(w, bits, group_size, fit))
        return new

    @classmethod
    def tied_to(cls, head: QuantizedLinear) -> QuantizedEmbedding:
        """An embedding that reads ``head``'s table (``V x D``): a tied input embedding."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_embeddings, new.embedding_dim = head.out_features, head.in_features
        object.__setattr__(new, "_head", head)  # not a submodule: saved once, under the head
        return new

    @property
    def source(self) -> QuantizedLinear:
        """The module holding the table: this embedding's own, or the tied head."""
        return self.__dict__.get("_head") or self._modules["table"]

    def forward(self, ids: Tensor) -> Tensor:
        """ids ``N..`` (int64 in ``[0, V)``) -> ``N.. x D``."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids: expected an int64 tensor of token ids, got {ids.dtype}")
        weight = self.source.weight_format
        flat = ids.reshape(-1).long()
        scales = weight.scales[flat]
        if weight.layout == "plain" and (weight.bits == 4 or weight.per_row) and native.takes(
                scales):
            # The rows' formula (``QuantizedWeight.rows``) in one C++ pass: a decoding step
            # looks up one row, where the formula's dozen ATen calls cost more than the work.
            if weight.bits == 8:
                w = native.dequantize_int8(weight.data[flat], scales, scales.dtype)
            else:
                w = native.dequantize_int4(weight.data[flat], scales, weight.zeros[flat],
                                           weight.group_size, scales.dtype)
            return w.view(*ids.shape, w.shape[-1])
        return weight.rows(ids.long())

    def extra_repr(self) -> str:
        tied = ", tied to the LM head" if "_head" in self.__dict__ else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tied}"


def _quantized_by_rows(weight: Tensor, bits: int, group_size: int, fit: str = "nearest",
                       scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """``quantize(weight, bits, group_size, scale_dtype or weight.dtype, fit)`` a block of
    rows at a time:
    every scale is a row's or a row group's, so the codes are the same, while the float32
    temporaries are a block's (about 4 MiB each), not the whole weight's (an embedding of
    Qwen2.5-0.5B: 0.5 GiB each)."""
    rows, cols = weight.shape
    step = max(1, 2**20 // cols // STEP_ROWS) * STEP_ROWS  # coded scales' steps: whole blocks
    blocks = []
    for i in range(0, max(rows, 1), step):
        blocks.append(quantize(weight[i:i + step], bits, group_size if bits == 4 else None,
                               scale_dtype or weight.dtype, fit if bits == 4 else "nearest"))
        return_free_pages()  # the block's temporaries (allocator module docstring)
    if len(blocks) == 1:
        return blocks[0]
    zeros = None if bits == 8 else torch.cat([b.zeros for b in blocks])
    steps = None if blocks[0].steps is None else torch.cat([b.steps for b in blocks])
    return QuantizedWeight(bits, torch.cat([b.data for b in blocks]),
                           torch.cat([b.scales for b in blocks]), zeros, steps=steps)
