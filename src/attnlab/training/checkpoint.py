"""Checkpoints: a folder with ``model.safetensors``, ``config.json`` and the trainer state.

``config.json`` holds ``{"format": "attnlab-checkpoint", "model_type", "model", "extra"}``
so that a folder can be recognised, the model rebuilt and the rest (vocabularies, task
options) restored. ``trainer_state.safetensors`` + ``trainer_state.json`` hold what an exact
resume needs (``attnlab.training.trainer_state``); nothing is ever unpickled.

A checkpoint is written in a hidden folder, fsync'd and swapped in (``attnlab.durable``):
a crash at any moment leaves the previous checkpoint or the new one, complete, and every
loader here finds it.

attnlab 0.1.0 reads the checkpoints written since its one decoder stack (commit d2db3a7,
2026-11-23: Hugging Face's tensor names, ``embed_tokens``, ``layers.{i}.self_attn.q_proj`` ...).
A ``DecoderLM`` checkpoint of the development versions before it (tensor names ``embed``,
``blocks.{i}.attn.in_proj_weight`` ...) is refused with an error that names the file and the
way to convert it: ``load_model`` then ``save_checkpoint`` with attnlab at commit d2db3a7,
which reads both layouts and writes today's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from attnlab.durable import existing_folder, new_folder, swap_in
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.pretrained import (
    contiguous_state,
    load_state,
    read_weights,
    shape_mismatch,
    stored_shapes,
)
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.trainer_state import TrainerState, read_trainer_state, write_trainer_state

__all__ = [
    "FORMAT",
    "check_current_layout",
    "checkpoint_folder",
    "load_config",
    "load_model",
    "load_trainer_state",
    "load_weights",
    "save_checkpoint",
]

FORMAT = "attnlab-checkpoint"
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    *,
    model_type: str,
    model_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    trainer_state: TrainerState | None = None,
) -> Path:
    """Write the checkpoint folder ``directory`` crash-safely; returns it."""
    directory = Path(directory)
    tmp = new_folder(directory)
    try:
        save_file(contiguous_state(model), str(tmp / WEIGHTS))
        config = {
            "format": FORMAT,
            "model_type": model_type,
            "model": model_config,
            "extra": extra or {},
        }
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if trainer_state is not None:
            write_trainer_state(tmp, trainer_state)
        swap_in(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def checkpoint_folder(directory: str | Path) -> Path | None:
    """Where the checkpoint ``directory`` lies: itself, or the previous version kept beside
    it when a crash came in the middle of replacing it; None when there is none."""
    return existing_folder(Path(directory))


def load_config(directory: str | Path) -> dict[str, Any]:
    """Read and check ``config.json`` of a checkpoint folder."""
    directory = _existing(directory)
    path = directory / CONFIG
    if not path.is_file():
        raise ValueError(
            f"checkpoint: {str(path)!r} is missing; {str(directory)!r} is not an "
            "attnlab checkpoint folder"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"checkpoint: {str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint: {str(path)!r} is not an attnlab checkpoint config "
            f'(expected "format": "{FORMAT}")'
        )
    for key, kind, name in (("model_type", str, "a string"), ("model", dict, "an object"),
                            ("extra", dict, "an object")):
        if key in config and not isinstance(config[key], kind):
            raise ValueError(f"checkpoint: {str(path)!r}: {key!r} is {config[key]!r}; "
                             f"expected {name}")
    return config


def load_weights(directory: str | Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` into ``model``, strictly; errors name the file."""
    path = _existing(directory) / WEIGHTS
    load_state(model, _weights(path), path, "checkpoint")


def check_current_layout(directory: str | Path) -> None:
    """Raise a ``ValueError`` naming the file when the checkpoint's weights carry the tensor
    names of the ``DecoderLM`` before the one decoder stack (module docstring); read from the
    file's header alone."""
    path = _existing(directory) / WEIGHTS
    _check_layout(stored_shapes(path), path)


def load_trainer_state(directory: str | Path) -> TrainerState | None:
    """The saved trainer state, or None if the folder has none."""
    return read_trainer_state(_existing(directory))


def load_model(directory: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model of a checkpoint folder and load its weights: ``(model, config)``.

    The config's ``model_type`` (``"transformer"`` or ``"decoder_lm"``) picks the class and
    ``model`` its config; a config that does not fit the weights raises a ``ValueError``.
    """
    directory = _existing(directory)
    config = load_config(directory)
    classes = {
        "transformer": (Transformer, TransformerConfig),
        "decoder_lm": (DecoderLM, DecoderLMConfig),
    }
    kind = config.get("model_type")
    if kind not in classes:
        raise ValueError(
            f"checkpoint: model_type {kind!r} in {str(Path(directory) / CONFIG)!r} "
            f"is not one of {sorted(classes)}"
        )
    model_cls, config_cls = classes[kind]
    try:
        model_config = config_cls.from_dict(config["model"])
        with torch.device("meta"):  # shapes without memory: a config from elsewhere may be huge
            skeleton = model_cls(model_config)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ValueError(
            f"checkpoint: bad model config in {str(directory / CONFIG)!r} ({error})"
        ) from None
    path = directory / WEIGHTS
    state = _weights(path)  # memory-mapped: nothing read yet
    wrong = shape_mismatch({name: tuple(t.shape) for name, t in state.items()}, skeleton, path,
                           "checkpoint")
    if wrong:
        raise ValueError(wrong)
    model = model_cls(model_config)  # the file holds every tensor: its size bounds this one
    load_state(model, state, path, "checkpoint")
    model.eval()
    return model, config


def _existing(directory: str | Path) -> Path:
    found = checkpoint_folder(directory)
    if found is None:
        raise FileNotFoundError(f"checkpoint: no such folder {str(directory)!r}")
    return found


def _weights(path: Path) -> dict[str, Tensor]:
    """The tensors of ``path``, refused when they carry the old layout's names."""
    tensors = read_weights(path, "checkpoint")
    _check_layout(tensors, path)
    return tensors


def _check_layout(names: Collection[str], path: Path) -> None:
    # The old DecoderLM's token embedding was ``embed`` and its blocks ``blocks``; one of them
    # is stored even when the head is tied.
    if any(name == "embed.weight" or name.startswith("blocks.") for name in names):
        raise ValueError(
            f"checkpoint: {str(path)!r} holds the tensor names of the DecoderLM before "
            "attnlab's one decoder stack (embed, blocks.*), which this version does not read; "
            "convert it with attnlab at commit d2db3a7 (load_model, then save_checkpoint to a "
            "new folder), or train again")
