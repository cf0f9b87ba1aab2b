"""Checkpoints: a folder with ``model.safetensors``, ``config.json`` and the trainer state.

``config.json`` holds ``{"format": "attnlab-checkpoint", "model_type", "model", "extra"}``
so that a folder can be recognised, the model rebuilt and the rest (vocabularies, task
options) restored. ``trainer_state.safetensors`` + ``trainer_state.json`` hold what an exact
resume needs (``attnlab.training.trainer_state``); nothing is ever unpickled.

A checkpoint is written in a hidden folder, fsync'd and swapped in (``training.durable``):
a crash at any moment leaves the previous checkpoint or the new one, complete, and every
loader here finds it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model
from torch import nn

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.durable import existing_folder, new_folder, swap_in
from attnlab.training.trainer_state import TrainerState, read_trainer_state, write_trainer_state

__all__ = [
    "FORMAT",
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
        save_model(model, str(tmp / WEIGHTS))
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
    if not path.is_file():
        raise ValueError(f"checkpoint: {str(path)!r} is missing")
    try:
        missing, unexpected = load_safetensors_into(model, str(path), strict=False)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(_unreadable(path, model, error)) from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: {str(path)!r} does not match the model: missing "
            f"{sorted(missing)}, unexpected {sorted(unexpected)}"
        )


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
    wrong = _shape_mismatch(directory / WEIGHTS, skeleton)
    if wrong:
        raise ValueError(wrong)
    model = model_cls(model_config)  # the file holds every tensor: its size bounds this one

    load_weights(directory, model)
    model.eval()
    return model, config


def _existing(directory: str | Path) -> Path:
    found = checkpoint_folder(directory)
    if found is None:
        raise FileNotFoundError(f"checkpoint: no such folder {str(directory)!r}")
    return found


def _unreadable(path: Path, model: nn.Module, error: Exception) -> str:
    """Why ``path`` did not load into ``model``: the tensors whose stored shape differs from
    the one the config gives, or else a truncated or corrupt file."""
    return (_shape_mismatch(path, model)
            or f"checkpoint: cannot read {str(path)!r}: the file is truncated or corrupt "
            f"({error})")


def _shape_mismatch(path: Path, model: nn.Module) -> str | None:
    """The tensors of ``path`` whose shape differs from ``model``'s; None if none differ or
    the file cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError):
        return None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [f"{name}: {shape} in the file, {expected[name]} from the config"
             for name, shape in stored.items() if name in expected and shape != expected[name]]
    # tied tensors (one tensor under two names) are stored once, under either name
    stored_ids = {id(t) for name, t in model.state_dict(keep_vars=True).items()
                  if name in stored}
    wrong += [f"{name}: not in the file"
              for name, t in model.state_dict(keep_vars=True).items()
              if name not in stored and id(t) not in stored_ids]
    if not wrong:
        return None
    more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
    return (f"checkpoint: the config does not match the weights in {str(path)!r}: "
            + "; ".join(wrong[:4]) + more)
