"""English calibration text for GPTQ from what ships on a Debian-like machine with attnlab's
environment: the licences in ``/usr/share/common-licenses`` and the package descriptions
(``METADATA``) of the installed Python packages, their code blocks and tables left out.

A developer script (issue 42, point 4)::

    python benchmarks/scripts/calibration_text.py FOLDER OUT.txt [--tokens 8000]

writes at most ``--tokens`` tokens (FOLDER's tokenizer) of each of the two sources, the
licences first. The quantization tutorial's GPTQ rows were calibrated on it (8,000 + 8,002
tokens with SmolLM2's tokenizer); the scored text (``benchmarks/texts/harbour.txt``) is not
in it.
"""

from __future__ import annotations

import argparse
import re
import site
from pathlib import Path

LICENCES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0", "LGPL-2.1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a model folder with tokenizer.json")
    parser.add_argument("out", type=Path, help="text file to write")
    parser.add_argument("--tokens", type=int, default=8000, help="tokens of each source")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.folder / "tokenizer.json"))
    licences = "".join(Path("/usr/share/common-licenses", name).read_text() + "\n\n"
                       for name in LICENCES)
    metadata = sorted(p for d in site.getsitepackages()
                      for p in Path(d).glob("*.dist-info/METADATA") if "attnlab" not in p.name
                      and "attnlab" not in p.parent.name)
    descriptions = "\n\n".join(prose(p) for p in metadata)
    parts = [tokenizer.decode(tokenizer.encode(text).ids[:args.tokens])
             for text in (licences, descriptions)]
    args.out.write_text("\n\n".join(parts), encoding="utf-8")


def prose(path: Path) -> str:
    """The description of a METADATA file (after its headers), prose lines only."""
    body = path.read_text(errors="replace").split("\n\n", 1)[-1]
    lines, in_code = [], False
    for line in body.splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith(("    ", ">>>", "$ ", "|", "..", "<")):
            continue
        if len(re.findall(r"[A-Za-z]", line)) < 0.6 * max(1, len(line)):
            continue
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
