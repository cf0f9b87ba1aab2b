"""The import contracts of ``.importlinter`` hold, and the check can fail.

``lint-imports`` runs in a subprocess on the real package; the second and third tests run
the same machinery on a contract that the package breaks and on a small package with a cycle,
so that the first test is known to look at the imports at all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / ".importlinter"
_RUN = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def lint(config: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _RUN, str(config)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_the_package_keeps_its_import_contracts() -> None:
    result = lint(CONTRACT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_swapped_layers_are_reported(tmp_path: Path) -> None:
    # layers imports attention (SelfAttention runs scaled_dot_product_attention): with the
    # two swapped, the same package must break the contract, naming the importer.
    text = CONTRACT.read_text()
    assert "    layers | functional\n    attention\n" in text
    bad = tmp_path / "swapped.ini"
    bad.write_text(text.replace("    layers | functional\n    attention\n",
                                "    attention\n    layers | functional\n"))
    result = lint(bad)
    assert result.returncode == 1
    assert "attnlab.layers is not allowed to import attnlab.attention" in result.stdout
    assert "attnlab.layers.self_attention -> attnlab.attention" in result.stdout


def test_a_cycle_is_reported(tmp_path: Path) -> None:
    package = tmp_path / "cyclic"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "core.py").write_text("from cyclic import high\n")
    (package / "high.py").write_text("from cyclic.low import core\n")
    config = tmp_path / "cyclic.ini"
    config.write_text(textwrap.dedent("""\
        [importlinter]
        root_packages =
            cyclic

        [importlinter:contract:no-cycles]
        name = No import cycles
        type = acyclic_siblings
        ancestors =
            cyclic
        """))
    result = lint(config, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No cycles are allowed in cyclic" in result.stdout
    assert ".low -> .high" in result.stdout
    (package / "low" / "core.py").write_text("")  # one way only: kept
    assert lint(config, cwd=tmp_path).returncode == 0
