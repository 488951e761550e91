"""The examples/ scripts, each in its own process (frameworks set global state): each prints a
JSON line and exits 0 only when its run is exact."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize(
    "script,package",
    [("trainer_resume.py", "transformers"), ("accelerate_loop.py", "accelerate"),
     ("lightning_resume.py", "lightning"), ("delayed_resume.py", "lightning")],
)  # fmt: skip
@pytest.mark.slow
def test_example_runs_and_is_exact(script, package):
    pytest.importorskip(package)
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300
    )
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, f"{script}: {last}\n{r.stderr[-2000:]}"
    assert json.loads(last)["exact"] is True
