"""Checkpoints: a folder with ``model.safetensors``, ``config.json`` and ``trainer_state.pt``.

``config.json`` holds ``{"format": "attnlab-checkpoint", "model_type", "model", "extra"}``
so that a folder can be recognised, the model rebuilt and the rest (vocabularies, task
options) restored. ``trainer_state.pt`` holds what an exact resume needs: optimizer,
scheduler, step, RNG states, best metric. Writes go to a temporary folder that is renamed
into place, so an interruption never leaves a broken checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model
from torch import nn

__all__ = [
    "FORMAT",
    "load_config",
    "load_model",
    "load_trainer_state",
    "load_weights",
    "save_checkpoint",
]

FORMAT = "attnlab-checkpoint"
WEIGHTS, CONFIG, STATE = "model.safetensors", "config.json", "trainer_state.pt"


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    *,
    model_type: str,
    model_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint folder atomically (temporary folder, then rename); returns it."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
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
            torch.save(trainer_state, tmp / STATE)
        old = None
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_config(directory: str | Path) -> dict[str, Any]:
    """Read and check ``config.json`` of a checkpoint folder."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint: no such folder {str(directory)!r}")
    path = directory / CONFIG
    if not path.is_file():
        raise ValueError(
            f"checkpoint: {str(path)!r} is missing; {str(directory)!r} is not an "
            "attnlab checkpoint folder"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"checkpoint: {str(path)!r} is not valid JSON ({error})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint: {str(path)!r} is not an attnlab checkpoint config "
            f'(expected "format": "{FORMAT}")'
        )
    return config


def load_weights(directory: str | Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` into ``model``, strictly; errors name the file."""
    path = Path(directory) / WEIGHTS
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


def load_trainer_state(directory: str | Path) -> dict[str, Any] | None:
    """The saved trainer state, or None if the folder has none."""
    path = Path(directory) / STATE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ValueError(f"checkpoint: cannot read {str(path)!r} ({error})") from None


def load_model(directory: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model of a checkpoint folder and load its weights: ``(model, config)``.

    The config's ``model_type`` (``"transformer"`` or ``"decoder_lm"``) picks the class and
    ``model`` its config; a config that does not fit the weights raises a ``ValueError``.
    """
    from attnlab.models.decoder import DecoderLM, DecoderLMConfig
    from attnlab.models.transformer import Transformer, TransformerConfig

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
        model = model_cls(config_cls.from_dict(config["model"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"checkpoint: bad model config in {str(Path(directory) / CONFIG)!r} ({error})"
        ) from None
    load_weights(directory, model)
    model.eval()
    return model, config


def _unreadable(path: Path, model: nn.Module, error: Exception) -> str:
    """Why ``path`` did not load into ``model``: the tensors whose stored shape differs from
    the one the config gives, or else a truncated or corrupt file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError):
        stored = {}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [f"{name}: {shape} in the file, {expected[name]} from the config"
             for name, shape in stored.items() if name in expected and shape != expected[name]]
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        return (f"checkpoint: the config does not match the weights in {str(path)!r}: "
                + "; ".join(wrong[:4]) + more)
    return f"checkpoint: cannot read {str(path)!r}: the file is truncated or corrupt ({error})"
