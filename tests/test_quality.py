"""benchmarks/quality.py on the CPU: the runs, their table and JSON, --table-only, the skipping of
done runs, a failed run's row, the verdict's rule, and the checks of its options."""

import contextlib
import io
import json
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality  # noqa: E402

SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "3",
         "--batch-size", "2", "--seq-len", "32", "--settings", "torch-adamw,fp32", "--seeds", "2",
         "--seeds-for", "torch-adamw", "--eval-batches", "2", "--parallel", "2"]  # fmt: skip


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = quality.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Three real train subprocesses (torch-adamw seeds 0 and 1, fp32 seed 0), two at a time."""
    out = tmp_path_factory.mktemp("quality") / "out"
    rc, table, progress = _main([*SMOKE, "--out", str(out)])
    return rc, table, progress, out


def _row(table: str, setting: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith(f"| {setting} |")]
    assert len(rows) == 1, table
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


@pytest.mark.slow
def test_quality_runs_every_setting_and_seed_into_its_table_and_json(smoke):
    rc, table, progress, out = smoke
    assert rc == 0, progress
    results = json.loads((out / "quality.json").read_text())
    assert [(r["setting"], r["seed"]) for r in results["runs"]] == [
        ("torch-adamw", 0), ("torch-adamw", 1), ("fp32", 0)]  # fmt: skip
    corpus = (out / "corpus.txt").read_bytes()
    assert results["corpus"]["nbytes"] == len(corpus) > 10**6
    assert (out / ".gitignore").read_text().splitlines()[-1] == "corpus.txt"  # not committed
    assert corpus.startswith(b"# ==> ") and b"# ==> os.py\n" in corpus
    headers = [
        line[6:] for line in corpus.decode("latin-1").splitlines() if line.startswith("# ==> ")
    ]
    assert headers == sorted(headers) and "os.py" in headers and "json/decoder.py" in headers
    assert not any(
        {"site-packages", "test", "tests", "idlelib"} & set(h.split("/")) for h in headers
    )
    assert results["torch"] and "command" in results and "git_commit" in results
    for r in results["runs"]:
        name = f"{r['setting']}-seed{r['seed']}"
        assert json.loads((out / "runs" / f"{name}.json").read_text()) == r["summary"]
        log = (out / "runs" / f"{name}.log").read_text()
        assert f"--seed {r['seed']}" in log.splitlines()[0] and "--no-progress" in log
        pinned = quality.core_slices(2) is not None  # one core each on a 2-core machine
        assert log.startswith("$ taskset -c ") == pinned, log.splitlines()[0]
        assert r["summary"]["optimizer"] == ("adamw" if r["setting"] == "torch-adamw" else "hybrid")
    # one progress line per run, the last saying none is left
    lines = [line for line in progress.splitlines() if " seed " in line]
    assert len(lines) == 3 and lines[-1].endswith("0 run(s) left"), progress

    torch_losses = [r["summary"]["final_heldout_loss"] for r in results["runs"][:2]]
    fp32_loss = results["runs"][2]["summary"]["final_heldout_loss"]
    assert all(math.isfinite(x) for x in [*torch_losses, fp32_loss])
    ref = _row(table, "torch-adamw")
    assert ref[1] == "2" and ref[2] == ", ".join(f"{x:.4f}" for x in torch_losses)
    assert ref[3] == f"{statistics.mean(torch_losses):.4f}" and ref[6] == "reference"
    assert ref[4] == f"{statistics.stdev(torch_losses):.4f}"
    row = _row(table, "fp32")
    assert row[1] == "1" and row[2] == f"{fp32_loss:.4f}" and row[4] == "n/a"
    diff = fp32_loss - statistics.mean(torch_losses)
    assert row[5] == f"{diff:+.4f}"
    bound = max(2 * statistics.stdev(torch_losses), max(torch_losses) - min(torch_losses))
    assert row[6] == ("within torch's seed spread" if abs(diff) <= bound else "outside")
    assert float(row[7]) > 0 and row[8] == "0.00"  # median step ms; no GPU
    # against fp32 (the second reference): one seed gives no spread
    assert row[9:] == ["+0.0000", "reference"]
    assert ref[9:] == [f"{-diff:+.4f}", "n/a (fp32 needs >= 2 seeds)"]
    assert quality.RULE in table


@pytest.mark.slow
def test_quality_table_only_reprints_the_table_and_a_rerun_keeps_the_done_runs(smoke):
    _, table, _, out = smoke
    with mock.patch.object(quality, "run_one", side_effect=AssertionError("ran")):
        rc, again, _ = _main(["--out", str(out), "--table-only"])
        assert rc == 0 and again == table
        rc, rerun, progress = _main([*SMOKE, "--out", str(out)])  # every .json is there
    assert rc == 0 and rerun == table and "3 run(s) kept" in progress
    # other options than the kept runs': refused, not mixed into one table
    rc, _, err = _main([*SMOKE, "--out", str(out), "--steps", "4"])
    assert rc == 2 and "--steps 3 -> 4; --eval-every 3 -> 4" in err, err


def _fake(losses: dict[tuple[str, int], float | None]):
    """A ``command`` whose runs print a summary with the given loss, or fail (None) with exit 3."""

    def command(args, setting, seed, corpus):
        loss = losses[setting, seed]
        if loss is None:
            code = (
                "import sys; print('step 1'); print('no kernel here', file=sys.stderr); sys.exit(3)"
            )
        else:
            line = json.dumps({"final_heldout_loss": loss, "median_step_ms": 10.0 + seed,
                               "peak_gpu_gb": 1.5, "seed": seed})  # fmt: skip
            code = f"print('log line'); print({line!r})"
        # the corpus must be found from the run's working folder (the repo's root)
        code = f"import os, sys; os.path.isfile({corpus!r}) or sys.exit(4); {code}"
        return [sys.executable, "-c", code, "train", "--data", corpus, "--seed", str(seed)]

    return command


def test_quality_reports_a_failed_run_in_its_row_and_exits_1(tmp_path, monkeypatch):
    monkeypatch.delenv(
        "PYTHONUNBUFFERED", raising=False
    )  # the runs' own setting must order the log
    losses = {("torch-adamw", 0): 1.0, ("torch-adamw", 1): 1.5, ("int8-moments", 0): 1.25,
              ("int8-moments", 1): None, ("bf16-sr", 0): 2.0}  # fmt: skip
    monkeypatch.chdir(tmp_path)  # a relative --out, from another folder than the runs'
    argv = ["--device", "cpu", "--settings", "torch-adamw,int8-moments,bf16-sr", "--seeds", "2",
            "--out", "o"]  # fmt: skip
    with mock.patch.object(quality, "command", _fake(losses)):
        rc, table, progress = _main(argv)
    assert rc == 1 and "1 run(s) failed: int8-moments seed 1" in progress
    assert "int8-moments seed 1: FAILED exit 3: no kernel here," in progress
    row = _row(table, "int8-moments")
    assert row[1] == "2" and row[2] == "1.2500, seed 1 failed (exit 3: no kernel here)"
    assert row[3] == "1.2500" and row[6] == "within torch's seed spread"
    assert _row(table, "bf16-sr")[5:7] == ["+0.7500", "outside"]
    assert _row(table, "torch-adamw")[7:9] == ["10.5", "1.50"]
    out = tmp_path / "o"
    assert not (out / "runs" / "int8-moments-seed1.json").exists()
    assert (out / "runs" / "int8-moments-seed1.log").read_text().endswith("no kernel here\n")
    assert json.loads((out / "quality.json").read_text())["runs"][3]["exit_code"] == 3


def _run(setting: str, seed: int, loss: float) -> dict:
    """A done run's row of quality.json."""
    return {"setting": setting, "seed": seed, "exit_code": 0,
            "summary": {"final_heldout_loss": loss, "median_step_ms": 1.0, "peak_gpu_gb": 0}}  # fmt: skip


def _results(runs: list[dict]) -> dict:
    """A quality.json of these runs (bf16 GPU settings), for quality.table."""
    return {"args": {"preset": "tiny", "dtype": "bf16", "device": "cuda", "steps": 1,
                     "batch_size": 1, "seq_len": 1, "lr": None, "grad_clip": 1.0,
                     "offload_fraction": 1.0, "eval_batches": 1, "parallel": 1},
            "corpus": {"nbytes": 1, "sha256": "0" * 64}, "torch": "x", "runs": runs}  # fmt: skip


@pytest.mark.parametrize(
    "torch_losses, mean, verdict",
    [
        ([1.0, 1.5, 1.25], 1.75, "within torch's seed spread"),  # 2 std = range = 0.5: the edge
        ([1.0, 1.5, 1.25], 1.8125, "outside"),
        ([1.0, 1.5], 1.25 + 0.70, "within torch's seed spread"),  # 2 std 0.707 > range 0.5
        ([1.0, 1.5], 1.25 + 0.71, "outside"),
        (
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5],
            1.45,
            "within torch's seed spread",
        ),  # 2 std
        # 0.33 < |diff| 0.39 <= range 0.5
        ([1.0], 1.0, "n/a (torch-adamw needs >= 2 seeds)"),  # range needs two
        ([], 1.0, "n/a (no torch-adamw run)"),
    ],
)
def test_quality_verdict_is_within_max_of_two_std_and_the_range(torch_losses, mean, verdict):
    results = _results([*(_run("torch-adamw", k, x) for k, x in enumerate(torch_losses)),
                        _run("int8-moments", 0, mean)])  # fmt: skip
    text = quality.table(results)
    assert _row(text, "int8-moments")[6] == verdict
    # bf16 params: torch's AdamW keeps bf16 moments and no master, and the footer says so
    assert ("torch-adamw on bf16 params: bf16 weights and moments, no fp32 master" in text) == bool(
        torch_losses
    )


def test_quality_judges_each_setting_against_fp32_too():
    """torch-adamw on bf16 params keeps no fp32 master; the last two columns judge a setting
    against HybridAdamW's fp32 default with the same rule."""

    results = _results([_run("torch-adamw", 0, 2.0), _run("torch-adamw", 1, 2.5),
                        _run("fp32", 0, 1.0), _run("fp32", 1, 1.5), _run("int8-moments", 0, 1.375),
                        _run("bf16-sr", 0, 2.25)])  # fmt: skip
    text = quality.table(results)
    assert _row(text, "int8-moments")[5:7] == ["-0.8750", "outside"]  # bound 0.707
    assert _row(text, "int8-moments")[9:] == ["+0.1250", "within fp32's seed spread"]
    assert _row(text, "bf16-sr")[9:] == ["+1.0000", "outside"]
    assert _row(text, "fp32")[9:] == ["+0.0000", "reference"]
    assert _row(text, "torch-adamw")[9:] == ["+1.0000", "outside"]


BAD = [
    (["--settings", "nonsense"], "argument --settings: 'nonsense' is not a setting"),
    (["--settings", "fp32,int4-moments"], "argument --settings: 'int4-moments' is not a setting"),
    (["--seeds-for", "torch"], "argument --seeds-for: 'torch' is not a setting"),
    (["--seeds", "0"], "argument --seeds: 0 is not an integer >= 1"),
    (["--parallel", "0"], "argument --parallel: 0 is not an integer >= 1"),
    (["--steps", "0"], "argument --steps: 0 is not an integer >= 1"),
    (["--preset", "tiny", "--seq-len", "129"], "--seq-len: 129 is more than the tiny preset's 128"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_quality_checks_its_options_before_anything_is_run(argv, message, capsys, tmp_path):
    with mock.patch.object(quality, "build_corpus", side_effect=AssertionError("built")):
        with pytest.raises(SystemExit) as e:
            quality.main([*argv, "--device", "cpu", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {message}", line.index("error: ")), line
    assert not (tmp_path / "o").exists()


def test_quality_seeds_go_to_the_seeds_for_settings_only():
    args = quality.parse_args(["--device", "cpu", "--seeds", "2"])
    assert args.settings == list(quality.SETTINGS) and args.eval_every == args.steps == 2000
    assert quality.runs_of(args) == [
        ("torch-adamw", 0), ("torch-adamw", 1), ("fp32", 0), ("fp32", 1), ("bf16-moments", 0),
        ("int8-moments", 0), ("int8-moments", 1), ("bf16-sr", 0), ("bf16-sr+int8", 0),
        ("bf16-sr+int8", 1)]  # fmt: skip
    cmd = quality.command(args, "bf16-sr+int8", 1, "c.txt")
    assert cmd[1:4] == ["-m", "offloadopt", "train"]
    assert " ".join(cmd).endswith(
        "--seed 1 --no-progress --optimizer hybrid --master-weights bf16-sr --state-dtype int8 "
        "--offload-fraction 1.0"
    )
    assert "--offload-fraction" not in quality.command(args, "torch-adamw", 0, "c.txt")


def test_quality_gives_parallel_runs_disjoint_cores(monkeypatch):
    """P runs each sized to every core oversubscribe the host (two tiny CPU runs on 2 cores:
    0.5 s a step became 3 s): each slot gets its own slice."""
    monkeypatch.setattr(
        quality.os, "sched_getaffinity", lambda pid: set(range(2, 19)), raising=False
    )
    monkeypatch.setattr(quality.shutil, "which", lambda name: "/usr/bin/" + name)
    assert quality.core_slices(4) == [
        [2, 3, 4, 5],
        [6, 7, 8, 9],
        [10, 11, 12, 13],
        [14, 15, 16, 17],
    ]
    assert quality.core_slices(1) is None and quality.core_slices(18) is None
    monkeypatch.setattr(quality.shutil, "which", lambda name: None)
    assert quality.core_slices(4) is None


def test_quality_ctrl_c_starts_no_queued_run(tmp_path):
    calls = []

    def run_one(*args):
        calls.append(args[1:3])
        raise KeyboardInterrupt

    argv = ["--device", "cpu", "--settings", "torch-adamw,fp32,bf16-sr", "--out", str(tmp_path)]
    with mock.patch.object(quality, "run_one", run_one):
        rc, _, err = _main(argv)
    assert rc == 130 and calls == [("torch-adamw", 0)] and "interrupted" in err
