"""The command line starts without torch: ``offloadopt --help`` and each command's ``--help``
build their parsers from ``offloadopt.harness.options`` (torch, transformers and matplotlib
are imported only when a command runs). Checked by what is imported, not by a timing."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every --help, in one fresh interpreter; then what it imported
PROBE = """
import contextlib, io, sys
from offloadopt.cli import COMMANDS, main
for argv in ([], *([name] for name in COMMANDS)):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*argv, "--help"]) == 0, argv
    assert "usage: offloadopt" in out.getvalue(), argv
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "matplotlib",
                                                         "numpy", "tqdm"})
print(",".join(heavy) or "none")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` with this checkout's offloadopt (conftest.py)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip


def test_help_imports_no_torch():
    r = _python(PROBE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", f"--help imported {r.stdout.strip()}"


@pytest.mark.slow
def test_import_offloadopt_is_lazy_and_its_names_resolve():
    r = _python(
        "import sys, offloadopt\n"
        "assert 'torch' not in sys.modules\n"
        "from offloadopt import HybridAdamW, audit\n"
        "import offloadopt.audit\n"
        "assert offloadopt.audit is audit and callable(audit), offloadopt.audit\n"
        "assert offloadopt.HybridAdamW is HybridAdamW\n"
        "assert set(offloadopt.__all__) <= set(dir(offloadopt))\n"
        "print('ok')"
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_option_names_match_what_builds_them():
    from offloadopt.harness import anchors, gpt, models, presets

    assert presets.ANCHOR_NAMES == tuple(anchors.ANCHORS)
    assert anchors.MODES is presets.MODES and gpt.PRESETS is presets.PRESETS
    assert models.MODEL_PRESETS == [*presets.PRESETS, *presets.HF_PRESETS]
