"""RoPE frequencies with the context-extension scalings of transformers 5.

A rotary embedding turns position ``p`` into the angles ``p * inv_freq_i``,
``inv_freq_i = base^(-2i/R)`` for ``i < R/2`` (``R`` = rotary_dim). Each scaling changes
``inv_freq`` (and may multiply cos and sin by an attention factor) so that a model trained on
``original_max_position_embeddings`` positions reads longer inputs:

- ``default``: the formula above;
- ``linear``: ``inv_freq / factor`` (positions interpolated by ``factor``);
- ``dynamic`` (NTK): ``base`` raised to ``base * (factor * s / M - (factor - 1))^(R / (R-2))``
  once the sequence length ``s`` passes ``M`` = max_position_embeddings (see
  ``RotaryEmbedding`` for when it is recomputed);
- ``yarn``: extrapolated high frequencies, interpolated low ones and a linear ramp between
  them, cos and sin multiplied by ``0.1 ln(factor) + 1`` (or the mscale ratio);
- ``llama3``: low frequencies divided by ``factor``, high ones kept, smoothed between;
- ``longrope`` (Phi-3): per-frequency divisors, ``short_factor`` up to
  ``original_max_position_embeddings`` positions and ``long_factor`` beyond.

Each formula is transformers' ``ROPE_INIT_FUNCTIONS[rope_type]``, computed the same way in
float32 so that the results agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab._checks import check_positive, is_number

__all__ = ["ROPE_TYPES", "RopeScaling", "check_rope_arguments", "rope_inverse_frequencies"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# Keys of a transformers rope_parameters dict that are not scaling fields: the base and the
# rotary fraction are the caller's (rope_inverse_frequencies' base and rotary_dim), "type" is
# the old spelling of "rope_type".
_HF_OTHER_KEYS = ("rope_theta", "partial_rotary_factor", "type")
# The keys transformers' validation requires (original_max_position_embeddings it fills in).
_HF_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                     "longrope": ("short_factor", "long_factor")}


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE's frequencies are scaled: transformers' ``rope_scaling`` / ``rope_parameters``.

    ``factor`` None (yarn, longrope) means ``max_position_embeddings /
    original_max_position_embeddings``; ``original_max_position_embeddings`` None means
    ``max_position_embeddings`` (both as transformers fills them in). The fields a
    ``rope_type`` does not read are ignored by it. Invalid values raise a ``ValueError`` or
    ``TypeError`` naming the field.
    """

    rope_type: str = "default"
    factor: float | None = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope

    def __post_init__(self) -> None:
        if not isinstance(self.rope_type, str) or self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.factor is not None or self.rope_type in ("linear", "dynamic", "llama3"):
            self._set_number("factor", positive=True)
        if self.original_max_position_embeddings is not None:
            check_positive("original_max_position_embeddings",
                           self.original_max_position_embeddings)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            self._set_number(name, positive=name == "low_freq_factor")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                self._set_number(name, positive=name == "attention_factor")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor: expected a number > low_freq_factor="
                             f"{self.low_freq_factor} (llama3 divides by their difference), "
                             f"got {self.high_freq_factor}")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"truncate: expected a bool, got {self.truncate!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is None:
                if self.rope_type == "longrope":
                    raise ValueError(f"{name}: expected a list of numbers for longrope, got None")
                continue
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name}: expected a list of numbers, got {value!r}")
            items = tuple(_checked_number(f"{name}[{i}]", v, positive=True)
                          for i, v in enumerate(value))
            object.__setattr__(self, name, items)

    def _set_number(self, name: str, *, positive: bool) -> None:
        # Stored as a float, so that factor 8 (JSON) and 8.0 give equal, alike configs.
        object.__setattr__(self, name, _checked_number(name, getattr(self, name),
                                                       positive=positive))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (tuples as lists); ``from_dict`` reads it back."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RopeScaling:
        """The scaling whose fields are ``data`` (as ``to_dict`` writes); unknown keys refused."""
        if not isinstance(data, Mapping):
            raise TypeError(f"data: expected a mapping of RopeScaling fields, got "
                            f"{type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise ValueError(f"data: unknown RopeScaling fields {unknown}; expected some of "
                             f"{names}")
        return cls(**data)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, *, source: str = "rope_scaling"
                ) -> RopeScaling:
        """The scaling a ``config.json`` ``rope_scaling`` / ``rope_parameters`` dict describes.

        ``None`` or ``{}`` is the default RoPE. The type is ``rope_type`` (or the old ``type``);
        ``rope_theta`` and ``partial_rotary_factor`` are left to the caller. A key that
        transformers requires for the type must be there; a JSON ``null`` means "unset" where
        transformers reads it so (``beta_fast``, ``beta_slow``, yarn's ``factor``, ``mscale``,
        ``attention_factor``, ``original_max_position_embeddings``) and is refused elsewhere.
        ``source`` (e.g. ``"config.json: rope_scaling"``) starts every error message.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise TypeError(f"{source}: expected a JSON object (dict) or null, got "
                            f"{type(d).__name__} {d!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in names and k not in _HF_OTHER_KEYS)
        if unknown:
            raise ValueError(f"{source}: unsupported keys {unknown}; expected some of "
                             f"{sorted(names | set(_HF_OTHER_KEYS))}")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope_type: expected one of {ROPE_TYPES}, got "
                             f"{rope_type!r}")
        missing = [k for k in _HF_REQUIRED_KEYS.get(rope_type, ()) if k not in d]
        if missing:
            raise ValueError(f"{source}: rope_type {rope_type!r} needs the keys "
                             f"{list(_HF_REQUIRED_KEYS[rope_type])}, missing {missing}")
        # transformers reads a null beta as its default (`or`); other nulls reach the checks.
        fields = {k: v for k, v in d.items()
                  if k in names and not (v is None and k in ("beta_fast", "beta_slow"))}
        fields["rope_type"] = rope_type
        if rope_type == "longrope":
            fields.setdefault("factor", None)  # optional there: the ratio of the two lengths
        try:
            return cls(**fields)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{source}: {error}") from None


def rope_inverse_frequencies(rotary_dim: int, base: float, scaling: RopeScaling,
                             max_position_embeddings: int, *, seq_len: int | None = None
                             ) -> tuple[Tensor, float]:
    """``inv_freq`` (``R/2``, float32, on the CPU) and the attention factor for cos and sin.

    ``R`` = ``rotary_dim`` (the rotated features of a head, even), ``base`` the RoPE theta,
    ``max_position_embeddings`` transformers' ``config.max_position_embeddings``. ``seq_len``
    (dynamic, longrope) is the current sequence length, ``max(positions) + 1``; None is the
    value at construction (``max_position_embeddings`` for dynamic, short factors for longrope).
    Arguments are checked as ``check_rope_arguments`` checks them.
    """
    check_rope_arguments(rotary_dim, base, scaling, max_position_embeddings)
    if seq_len is not None:
        check_positive("seq_len", seq_len)
    compute = _INIT_FUNCTIONS[scaling.rope_type]
    inv_freq, attention_factor = compute(rotary_dim, float(base), scaling,
                                         max_position_embeddings, seq_len)
    # Values each in range can still combine past float32 (dynamic with a factor of 1e30
    # subtracts two equal numbers and raises 0 to a power): refused here, not as NaN logits.
    if not (bool(torch.isfinite(inv_freq).all()) and math.isfinite(attention_factor)):
        at = "" if seq_len is None else f" at sequence length {seq_len}"
        raise ValueError(f"rope_scaling: {scaling.rope_type} scaling with factor "
                         f"{scaling.factor} and base {base} gives non-finite rotary "
                         f"frequencies{at}")
    return inv_freq, float(attention_factor)


def check_rope_arguments(rotary_dim: int, base: float, scaling: RopeScaling,
                         max_position_embeddings: int) -> None:
    """Raise on the arguments ``rope_inverse_frequencies`` cannot take, computing nothing (so
    a module checks a huge ``rotary_dim`` before it allocates its ``R/2`` frequencies)."""
    check_positive("rotary_dim", rotary_dim)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even int, got {rotary_dim}")
    if _checked_number("base", base, positive=True) <= 1:
        raise ValueError(f"base: expected a finite number > 1, got {base!r}")
    if not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaling: expected a RopeScaling, got {type(scaling).__name__}")
    check_positive("max_position_embeddings", max_position_embeddings)
    if scaling.rope_type == "dynamic" and rotary_dim < 4:
        raise ValueError(f"rotary_dim: dynamic scaling raises base to the power R/(R-2), "
                         f"expected R >= 4, got {rotary_dim}")
    if scaling.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = getattr(scaling, name)
            if len(factors) != rotary_dim // 2:
                raise ValueError(f"scaling.{name}: expected rotary_dim/2 = {rotary_dim // 2} "
                                 f"numbers, got {len(factors)}")


def _default(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
             ) -> tuple[Tensor, float]:
    return _base_inv_freq(dim, base), 1.0


def _linear(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
            ) -> tuple[Tensor, float]:
    # Dividing the frequencies by factor is dividing the positions by factor.
    return _base_inv_freq(dim, base) / s.factor, 1.0


def _dynamic(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
             ) -> tuple[Tensor, float]:
    if seq_len is None:
        scale = s.factor * max_pos / max_pos - (s.factor - 1)
    else:
        # transformers gets seq_len as a tensor when the sequence grows and does this
        # arithmetic in float32; so do we, to agree bit for bit.
        length = torch.tensor(max(seq_len, max_pos), device="cpu")
        scale = s.factor * length / max_pos - (s.factor - 1)
    return _base_inv_freq(dim, base * scale ** (dim / (dim - 2))), 1.0


def _yarn(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
          ) -> tuple[Tensor, float]:
    original = s.original_max_position_embeddings or max_pos
    factor = max_pos / original if s.factor is None else s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor,
                                                                             s.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # transformers treats 0 as unset, hence `or`.
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        # The feature index whose wavelength fits `rotations` times in the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp divides by high - low
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    pos_freqs = base ** (_even_indices(dim) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
            ) -> tuple[Tensor, float]:
    inv_freq = _base_inv_freq(dim, base)
    old_context = s.original_max_position_embeddings or max_pos
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                            - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _longrope(dim: int, base: float, s: RopeScaling, max_pos: int, seq_len: int | None
              ) -> tuple[Tensor, float]:
    original = s.original_max_position_embeddings or max_pos
    factor = max_pos / original if s.factor is None else s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    long = seq_len is not None and seq_len > original
    name = "long_factor" if long else "short_factor"
    ext = torch.tensor(getattr(s, name), dtype=torch.float32, device="cpu")
    return 1.0 / (ext * base ** (_even_indices(dim) / dim)), attention_factor


def _base_inv_freq(dim: int, base: float | Tensor) -> Tensor:
    return 1.0 / (base ** (_even_indices(dim) / dim))


def _even_indices(dim: int) -> Tensor:
    # On the CPU even inside a `torch.device("meta")` block (models built empty, then loaded).
    return torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")


_INIT_FUNCTIONS = {"default": _default, "linear": _linear, "dynamic": _dynamic,
                   "yarn": _yarn, "llama3": _llama3, "longrope": _longrope}


def _checked_number(name: str, value: object, *, positive: bool) -> float:
    if not is_number(value):
        raise TypeError(f"{name}: expected a finite number, got {value!r}")
    if not is_number(value, finite=True):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return float(value)
