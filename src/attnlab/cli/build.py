"""``attnlab build``: compile the native kernels (``attnlab.kernels.native``) for this CPU and
torch into ``$ATTNLAB_CACHE_DIR/native`` (else ``~/.cache/attnlab/native``), where every later
process loads them; nothing else ever compiles. Says 'already built' at once when they are.
Without them everything runs the reference modules. Exit status 2 when a C++ compiler or
ninja is missing, 1 when the compile fails.
"""

from __future__ import annotations

import argparse
import sys

from attnlab.cli import add_command
from attnlab.kernels import native

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``build`` on the top-level sub-parsers."""
    add_command(sub, "build", __doc__).set_defaults(handler=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    try:
        native.build()
    except native.BuildError as error:
        print(f"attnlab build: {error}", file=sys.stderr)
        return 2 if isinstance(error, native.MissingToolError) else 1
    return 0
