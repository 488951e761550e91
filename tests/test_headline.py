"""The README's headline table and docs/benchmarks.md's figures agree with the newest
side-by-side run in benchmarks/results/ (tools/headline.py writes them; here it is run as a
program, ``--check``), and a newer run, or a stale page, is caught."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "headline.py"
RUN = ROOT / "benchmarks" / "results" / "2026-11-30-bench-h200"


def headline(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_the_table_and_the_results_folder_agree():
    r = headline("--check")
    assert r.returncode == 0, r.stderr
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- headline: generated") : readme.index("<!-- headline: end")]
    assert "commit " in block and "GPU " in block and "CPU " in block and "torch " in block


def _copy(tmp: Path) -> Path:
    for page in ("README.md", "docs/benchmarks.md"):
        (tmp / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp / page)
    shutil.copytree(RUN, tmp / "benchmarks" / "results" / RUN.name)
    return tmp


def test_a_newer_run_makes_the_pages_stale_until_they_are_rewritten(tmp_path):
    root = _copy(tmp_path)
    assert headline("--check", "--root", str(root)).returncode == 0
    run = json.loads(next(RUN.glob("*.json")).read_text())
    run |= {"commit": "abc1234", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.15.0+cu132",
            "cpu": "Intel Xeon (16 cores)", "versions": {"deepspeed": "0.20.1"}}  # fmt: skip
    for row in run["results"]:
        if row["name"] == "hybrid:1":
            row["step_ms"] = 476.25
    run["results"].append({**run["results"][-1], "name": "deepspeed-zenflow", "step_ms": 854.0})
    newer = root / "benchmarks" / "results" / "2099-01-01-bench-h100"
    newer.mkdir()
    (newer / "bench.json").write_text(json.dumps(run))
    # a newer folder without a side-by-side run (a sweep of modes, no anchors) is passed over
    sweep = root / "benchmarks" / "results" / "2099-02-01-modes-h100"
    sweep.mkdir()
    (sweep / "modes.json").write_text(json.dumps({**run, "results": run["results"][:3]}))
    stale = headline("--check", "--root", str(root))
    assert stale.returncode == 1 and "README.md, docs/benchmarks.md" in stale.stderr, stale.stderr
    assert headline("--root", str(root)).returncode == 0
    assert headline("--check", "--root", str(root)).returncode == 0
    readme = (root / "README.md").read_text()
    for text in ("commit abc1234", "NVIDIA H100 80GB HBM3", "torch 2.15.0+cu132",
                 "**476.2**", "DeepSpeed 0.20.1 ZenFlow", "benchmarks/results/2099-01-01-bench-h100",
                 "Intel Xeon (16 cores)"):  # fmt: skip
        assert text in readme, text
    assert "9e46f28" not in readme.split("<!-- headline: end")[0].split("headline: generated")[1]


def test_an_edited_table_is_caught(tmp_path):
    root = _copy(tmp_path)
    page = root / "README.md"
    page.write_text(page.read_text().replace("| **644.1** |", "| **600.0** |"))
    r = headline("--check", "--root", str(root))
    assert r.returncode == 1 and "README.md" in r.stderr
