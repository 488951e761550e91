"""A script of benchmarks/ run as a program, as a user runs it: no test imports one
(tests/test_layers.py).

:func:`run` starts one fresh Python process that runs the script once per command line
(``runpy.run_path(script, run_name="__main__")``, what ``python script ...`` does; the torch
import is paid once for all of them) and returns each run's exit status, stdout and stderr.
``prelude`` is code run in that process first: it may replace a function of offloadopt or of
the standard library (a failing build, a fake subprocess), never one of the script's own,
which does not exist yet when the prelude runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

_CHILD = """
import contextlib, io, json, runpy, sys, traceback
script, result, argvs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:0] = [str(__import__("pathlib").Path(script).parent)]  # as `python script` does
exec(compile(sys.stdin.read(), "<prelude>", "exec"), {"__name__": "prelude"})
runs = []
for argv in argvs:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *argv]
    rc = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # reported as a run that raised, with its traceback
            traceback.print_exc()
            rc = "raised"
    runs.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
with open(result, "w") as f:
    json.dump(runs, f)
"""


def run(script: str, *argvs: list[str], prelude: str = "", timeout: float = 300,
        cwd: str | os.PathLike | None = None) -> list[dict]:  # fmt: skip
    """Run ``benchmarks/<script>`` once per argv in one process; per run ``{"rc": exit status
    (or "raised"), "out": stdout, "err": stderr}``. Raises ``AssertionError`` with the process's
    stderr if the process itself failed."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "runs.json"
        cmd = [sys.executable, "-c", _CHILD, str(BENCHMARKS / script), str(result),
               json.dumps([list(a) for a in argvs])]  # fmt: skip
        # the child imports this checkout's offloadopt (conftest.py)
        p = subprocess.run(cmd, input=prelude, capture_output=True, text=True, timeout=timeout,
                           cwd=cwd or ROOT)  # fmt: skip
        assert p.returncode == 0 and result.exists(), p.stderr[-4000:]
        return json.loads(result.read_text())
