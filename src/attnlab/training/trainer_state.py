"""What an exact resume needs besides the weights, stored without pickle.

``trainer_state.safetensors`` holds every tensor: the optimizer's per-parameter state (named
``optimizer.<parameter index>.<name>``) and the RNG states as uint8 tensors, one per
process of the run (``rng.torch.<rank>``, ``rng.cuda.<rank>``). ``trainer_state.json``
holds the rest: step, best metric, patience count, last loss, the Python ``random`` state
and the training options. The learning-rate scheduler needs no state of its own: the
schedule is a pure function of the step.

Reading checks every key and type, so a damaged or hostile file raises a ``ValueError`` that
names it, never runs code and never fails later deep inside the optimizer. A folder with the
old pickled ``trainer_state.pt`` is refused: pickle can run code, so it is never loaded.
"""

from __future__ import annotations

import json
import random
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from attnlab._checks import is_int, is_number

__all__ = ["INFO", "LEGACY", "TENSORS", "TrainerState", "check_resumable",
           "checked_optimizer_state", "read_trainer_state", "write_trainer_state"]

TENSORS, INFO, LEGACY = "trainer_state.safetensors", "trainer_state.json", "trainer_state.pt"
FORMAT = "attnlab-trainer-state"


@dataclass(frozen=True)
class TrainerState:
    """The trainer's state at a step boundary. ``optimizer`` is ``optimizer.state_dict()
    ["state"]`` (parameter index -> name -> tensor); ``torch_rng`` and ``cuda_rng`` hold the
    RNG state of each rank (``cuda_rng`` is empty on CPU); ``python_rng`` is
    ``random.getstate()``."""

    step: int
    best: float | None
    bad_evals: int
    loss: float | None
    train_config: dict[str, Any]
    optimizer: dict[int, dict[str, Tensor]]
    torch_rng: tuple[Tensor, ...]
    cuda_rng: tuple[Tensor, ...]
    python_rng: tuple[Any, ...]


def write_trainer_state(folder: Path, state: TrainerState) -> None:
    """Write the two files of ``state`` into ``folder`` (the caller fsyncs and swaps it in)."""
    tensors = {
        f"optimizer.{index}.{name}": value.detach().cpu().contiguous()
        for index, entry in state.optimizer.items()
        for name, value in entry.items()
    }
    for kind, states in (("torch", state.torch_rng), ("cuda", state.cuda_rng)):
        tensors.update({f"rng.{kind}.{rank}": t for rank, t in enumerate(states)})
    save_file(tensors, str(folder / TENSORS))
    version, internal, gauss = state.python_rng
    info = {
        "format": FORMAT,
        "step": state.step,
        "best": state.best,
        "bad_evals": state.bad_evals,
        "loss": state.loss,
        "train_config": state.train_config,
        "python_rng": [version, list(internal), gauss],
    }
    (folder / INFO).write_text(json.dumps(info, indent=1) + "\n")


def read_trainer_state(folder: Path) -> TrainerState | None:
    """The state saved in ``folder``; None when it holds none (a weights-only checkpoint)."""
    info_path, tensor_path = folder / INFO, folder / TENSORS
    if not info_path.exists() and not tensor_path.exists():
        if (folder / LEGACY).exists():
            raise ValueError(
                f"checkpoint: {str(folder / LEGACY)!r} is a trainer state of an older attnlab, "
                "stored with pickle, which can run code and is never loaded; this run cannot "
                "be resumed (its weights still load): start a new run"
            )
        return None
    for path in (info_path, tensor_path):
        if not path.is_file():
            raise ValueError(f"checkpoint: {str(path)!r} is missing; the trainer state is "
                             "incomplete")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(
            f"checkpoint: cannot read {str(tensor_path)!r}: the file is truncated or corrupt "
            f"({error})"
        ) from None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"checkpoint: {str(info_path)!r} is not valid JSON ({error})") from None
    return _parse(info, tensors, info_path, tensor_path)


def check_resumable(state: TrainerState, config: dict[str, Any], may_change: tuple[str, ...],
                    world: int, folder: Path) -> None:
    """Refuse to resume ``state`` under the training options ``config`` when they differ from
    the saved ones other than in ``may_change``, or with another number of processes."""
    given = json.loads(json.dumps(config))  # tuples as JSON lists, as saved
    differ = [f"{key}: saved {state.train_config.get(key)!r}, given {value!r}"
              for key, value in given.items()
              if key not in may_change and state.train_config.get(key) != value]
    if differ:
        raise ValueError(f"resume: the run in {str(folder)!r} was saved with other options "
                         f"({'; '.join(differ)}); only {list(may_change)} may change on resume")
    if len(state.torch_rng) != world:
        raise ValueError(f"resume: the run in {str(folder)!r} was saved by "
                         f"{len(state.torch_rng)} processes and is resumed by {world}; an "
                         "exact resume needs the same number")


def checked_optimizer_state(state: TrainerState, optimizer: torch.optim.Optimizer,
                            folder: Path) -> dict[int, dict[str, Tensor]]:
    """The saved AdamW state, after checking that it fits ``optimizer``'s parameters and
    holds values AdamW can have: ``step`` a whole number in ``[0, state.step]`` (a parameter
    without a gradient skips a step), ``exp_avg`` finite, ``exp_avg_sq`` finite and
    ``>= 0``. A misfit would fail only at the next step, deep inside the optimizer (a
    negative ``step`` makes ``1 - beta ** step`` negative and its square root complex), or
    train on NaN."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {"step", "exp_avg", "exp_avg_sq"}
    for index, entry in state.optimizer.items():
        where = (f"checkpoint: {str(folder / TENSORS)!r}: optimizer state of parameter "
                 f"{index}")
        if index >= len(params):
            raise ValueError(f"{where}: the model has only {len(params)} parameters")
        if set(entry) != names:
            raise ValueError(f"{where} holds {sorted(entry)}; expected {sorted(names)}")
        for name, value in entry.items():
            shape = () if name == "step" else tuple(params[index].shape)
            if tuple(value.shape) != shape or not value.is_floating_point():
                raise ValueError(f"{where}: {name} is a {value.dtype} tensor of shape "
                                 f"{tuple(value.shape)}; expected a float tensor of shape "
                                 f"{shape}")
        step = entry["step"].item()
        if not (0 <= step <= state.step and step == int(step)):
            raise ValueError(f"{where}: step is {step}; expected a whole number from 0 to "
                             f"the run's step {state.step}")
        mean, square = entry["exp_avg"], entry["exp_avg_sq"]
        for name, bad, expected in (("exp_avg", ~torch.isfinite(mean), "finite values"),
                                    ("exp_avg_sq", ~(torch.isfinite(square) & (square >= 0)),
                                     "finite values >= 0")):
            if bad.any():
                raise ValueError(f"{where}: {name} holds {entry[name][bad][:3].tolist()}; "
                                 f"expected {expected}")
    return state.optimizer


def _parse(info: Any, tensors: dict[str, Tensor], info_path: Path,
           tensor_path: Path) -> TrainerState:
    def bad(key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"checkpoint: {str(info_path)!r}: {key!r} is {reprlib.repr(value)}; "
                          f"expected {expected}")

    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {str(info_path)!r} is not an attnlab trainer state "
                         f'(expected an object with "format": "{FORMAT}")')
    missing = sorted({"step", "best", "bad_evals", "loss", "train_config", "python_rng"}
                     - set(info))
    if missing:
        raise ValueError(f"checkpoint: {str(info_path)!r} lacks {missing}; the trainer state "
                         "is incomplete")
    for key in ("step", "bad_evals"):
        if not is_int(info[key]) or info[key] < 0:
            raise bad(key, info[key], "a non-negative int")
    for key in ("best", "loss"):
        # A NaN best would never be improved on (every comparison with NaN is false).
        value = info[key]
        if value is not None and not is_number(value, finite=True):
            raise bad(key, value, "a finite number or null")
    if not isinstance(info["train_config"], dict):
        raise bad("train_config", info["train_config"], "an object")
    return TrainerState(
        step=info["step"],
        best=info["best"],
        bad_evals=info["bad_evals"],
        loss=info["loss"],
        train_config=info["train_config"],
        optimizer=_optimizer_state(tensors, tensor_path),
        torch_rng=_rngs(tensors, "torch", tensor_path),
        cuda_rng=_rngs(tensors, "cuda", tensor_path),
        python_rng=_python_rng(info["python_rng"], bad),
    )


def _optimizer_state(tensors: dict[str, Tensor], path: Path) -> dict[int, dict[str, Tensor]]:
    state: dict[int, dict[str, Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith(("rng.torch.", "rng.cuda.")):
            continue
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "optimizer" or not parts[1].isdigit():
            raise ValueError(f"checkpoint: {str(path)!r} holds an unexpected tensor {name!r}; "
                             "expected optimizer.<index>.<name> or rng.*")
        state.setdefault(int(parts[1]), {})[parts[2]] = value
    return state


def _rngs(tensors: dict[str, Tensor], kind: str, path: Path) -> tuple[Tensor, ...]:
    """The RNG states ``rng.<kind>.0``, ``rng.<kind>.1``, ... (one per rank)."""
    names = {name for name in tensors if name.startswith(f"rng.{kind}.")}
    expected = {f"rng.{kind}.{rank}" for rank in range(len(names))}
    if names != expected or (kind == "torch" and not names):
        raise ValueError(f"checkpoint: {str(path)!r} holds the RNG states {sorted(names)}; "
                         f"expected rng.{kind}.0, rng.{kind}.1, ... (one per process)")
    states = tuple(tensors[f"rng.{kind}.{rank}"] for rank in range(len(names)))
    for rank, value in enumerate(states):
        name = f"rng.{kind}.{rank}"
        try:
            if kind == "torch":
                torch.Generator().set_state(value)
            elif value.dtype != torch.uint8 or value.dim() != 1:
                raise RuntimeError(f"a {value.dtype} tensor of shape {tuple(value.shape)}")
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"checkpoint: {str(path)!r}: {name!r} is not an RNG state; "
                             f"expected a uint8 tensor as from get_rng_state() ({error})"
                             ) from None
    return states


def _python_rng(value: Any, bad: Any) -> tuple[Any, ...]:
    expected = "[version, [625 ints], gauss or null] as from random.getstate()"
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)):
        raise bad("python_rng", value, expected)
    state = (value[0], tuple(value[1]), value[2])
    try:
        random.Random().setstate(state)
    except (TypeError, ValueError, OverflowError):
        raise bad("python_rng", value, expected) from None
    return state
