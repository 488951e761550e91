"""What a user sees of the package before running it: the version (one source, ``offloadopt
--version``), the license (an SPDX expression and its LICENSE file), the typing marker, the
classifiers, the CHANGELOG, and a ``test`` extra that holds everything the suite imports."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import offloadopt

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_version_is_written_once():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "offloadopt.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", offloadopt.__version__)
    assert metadata.version("offloadopt") == offloadopt.__version__  # the install agrees


def test_version_flag_prints_it_without_importing_torch():
    code = ("import sys; from offloadopt.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code in (0, None)\n"
            "print('torch' in sys.modules)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"offloadopt {offloadopt.__version__}", "False"]


def test_every_child_python_imports_this_checkout(tmp_path):
    """A child started elsewhere (a cwd outside the checkout; a script, whose folder comes first
    on its path) imports this checkout's offloadopt, as this process does (tests/conftest.py,
    pyproject.toml's pythonpath): under a venv shared by clones, such children imported the
    venv's editable install, another clone's code, and tested it."""
    here = ROOT / "offloadopt" / "__init__.py"
    assert Path(offloadopt.__file__).resolve() == here
    script = tmp_path / "where.py"
    script.write_text("import offloadopt\nprint(offloadopt.__file__)\n")
    for argv in (["-c", script.read_text()], [str(script)]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path,
                           timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).resolve() == here, argv


def test_the_license_is_an_spdx_expression_with_its_text():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639


def test_the_package_says_it_is_typed_and_ships_the_marker():
    assert (Path(offloadopt.__file__).parent / "py.typed").exists()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in data["package-data"]["offloadopt"]
    assert "Typing :: Typed" in PROJECT["classifiers"]


def test_classifiers_name_the_python_versions_the_package_requires():
    low = PROJECT["requires-python"].removeprefix(">=")
    pythons = [c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"]
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]  # fmt: skip
    assert pythons and pythons[0] == low, pythons


def test_the_test_extra_holds_what_the_suite_imports_optionally():
    """Every package a test skips without (pytest.importorskip) is in the test extra."""
    extras = PROJECT["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            name = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", req)
            if name[1] == "offloadopt":
                for sub in name[2].split(","):
                    out |= names(sub.strip())
            else:
                out.add(name[1].lower())
        return out

    imported = {"tensorboard": "tensorboard", "matplotlib": "matplotlib",
                "transformers": "transformers", "expecttest": "expecttest",
                "accelerate": "accelerate", "lightning": "lightning"}  # fmt: skip
    skipped = set()
    for path in (ROOT / "tests").rglob("*.py"):
        skipped |= set(re.findall(r"importorskip\(\s*\"([\w.]+)\"", path.read_text()))
    skipped -= {"tomllib"}  # the standard library's, from 3.11
    assert "tensorboard" in skipped
    missing = {m for m in skipped if imported.get(m, m) not in names("test")}
    assert not missing, f"tests skip without {missing}, which the test extra does not install"


def test_the_changelog_has_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(offloadopt.__version__)}\b", text, re.M), text[:300]
