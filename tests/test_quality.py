"""benchmarks/quality.py on the CPU, run as a program (tests/as_program.py: no test imports a
benchmark): the runs, their table and JSON, --table-only, the skipping of done runs, a failed
run's row, the verdict's rule, the cores of parallel runs, Ctrl-C, and the checks of its
options. A fake ``subprocess.run`` (the prelude) stands in for the training runs where their
losses are chosen."""

import json
import math
import os
import shlex
import shutil
import statistics

import as_program
import pytest

# A test that runs the script is slow: one process, about 1 s on 2 cores, and its runs.
pytestmark = pytest.mark.slow
SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "3",
         "--batch-size", "2", "--seq-len", "32", "--settings", "torch-adamw,fp32", "--seeds", "2",
         "--seeds-for", "torch-adamw", "--eval-batches", "2", "--parallel", "2"]  # fmt: skip
RULE = "|mean - torch_mean| <= max(2 * torch_std, torch_max - torch_min)"
# two parallel runs get one core each where there are two cores and taskset (core_slices)
PINNED = len(getattr(os, "sched_getaffinity", lambda pid: ())(0)) >= 2 and bool(
    shutil.which("taskset")
)


def _quality(*argvs: list[str], prelude: str = "", cwd=None) -> list[tuple[int, str, str]]:
    """Each argv's (exit status, stdout: the table, stderr: the progress)."""
    runs = as_program.run("quality.py", *argvs, prelude=prelude, cwd=cwd)
    return [(r["rc"], r["out"], r["err"]) for r in runs]


def fake_runs(losses: dict[str, float | None], interrupt: bool = False) -> str:
    """A prelude: each training run (``subprocess.run`` with the run's log as stdout) becomes
    one that prints a summary with the loss given for ``{setting}-seed{seed}`` (1.0 if none),
    or fails (None) with exit 3; ``interrupt``: the first run is a Ctrl-C instead (SIGINT to
    the process, and the run exits 130). Each run says "started NAME" on stderr."""
    return f"""
import os, signal, subprocess, sys, time
from pathlib import Path
LOSSES, INTERRUPT = {losses!r}, {interrupt!r}
real = subprocess.run
def run(cmd, **kw):
    if "train" not in cmd:  # git, for the results' commit
        return real(cmd, **kw)
    name = Path(kw["stdout"].name).stem
    print("started", name, file=sys.stderr)
    if INTERRUPT:  # Ctrl-C: SIGINT to the process (the main thread raises), the run ends too
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        return real([sys.executable, "-c", "import sys; sys.exit(130)"], **kw)
    loss, seed = LOSSES.get(name, 1.0), int(name.rsplit("-seed", 1)[1])
    corpus = cmd[cmd.index("--data") + 1]
    if loss is None:
        code = "import sys; print('step 1'); print('no kernel here', file=sys.stderr); sys.exit(3)"
    else:
        line = json.dumps({{"final_heldout_loss": loss, "median_step_ms": 10.0 + seed,
                           "peak_gpu_gb": 1.5, "seed": seed}})
        code = f"print('log line'); print({{line!r}})"
    # the corpus must be found from the run's working folder (the repo's root)
    code = f"import os, sys; os.path.isfile({{corpus!r}}) or sys.exit(4); {{code}}"
    return real([sys.executable, "-c", code], **kw)
import json
subprocess.run = run
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Three real train subprocesses (torch-adamw seeds 0 and 1, fp32 seed 0), two at a time."""
    out = tmp_path_factory.mktemp("quality") / "out"
    [(rc, table, progress)] = _quality([*SMOKE, "--out", str(out)])
    return rc, table, progress, out


def _row(table: str, setting: str) -> list[str]:
    rows = [line for line in table.splitlines() if line.startswith(f"| {setting} |")]
    assert len(rows) == 1, table
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


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
    pinned = PINNED  # one core each on a 2-core machine
    for r in results["runs"]:
        name = f"{r['setting']}-seed{r['seed']}"
        assert json.loads((out / "runs" / f"{name}.json").read_text()) == r["summary"]
        log = (out / "runs" / f"{name}.log").read_text()
        assert f"--seed {r['seed']}" in log.splitlines()[0] and "--no-progress" in log
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
    assert RULE in table


def test_quality_table_only_reprints_the_table_and_a_rerun_keeps_the_done_runs(smoke):
    _, table, _, out = smoke
    logs = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.log")}
    (rc, again, _), (rc2, rerun, progress), (rc3, _, err) = _quality(
        ["--out", str(out), "--table-only"],
        [*SMOKE, "--out", str(out)],  # every .json is there
        # other options than the kept runs': refused, not mixed into one table
        [*SMOKE, "--out", str(out), "--steps", "4"],
    )
    assert rc == 0 and again == table
    assert rc2 == 0 and rerun == table and "3 run(s) kept" in progress
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.log")} == logs  # none ran
    assert rc3 == 2 and "--steps 3 -> 4; --eval-every 3 -> 4" in err, err


def test_quality_reports_a_failed_run_in_its_row_and_exits_1(tmp_path, monkeypatch):
    monkeypatch.delenv(
        "PYTHONUNBUFFERED", raising=False
    )  # the runs' own setting must order the log
    losses = {"torch-adamw-seed0": 1.0, "torch-adamw-seed1": 1.5, "int8-moments-seed0": 1.25,
              "int8-moments-seed1": None, "bf16-sr-seed0": 2.0}  # fmt: skip
    # a relative --out, from another folder than the runs'
    argv = ["--device", "cpu", "--settings", "torch-adamw,int8-moments,bf16-sr", "--seeds", "2",
            "--out", "o"]  # fmt: skip
    [(rc, table, progress)] = _quality(argv, prelude=fake_runs(losses), cwd=tmp_path)
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


VERDICTS = [
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
]  # fmt: skip


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """``--table-only`` of a quality.json per verdict case, then of FP32_CASE."""
    tmp = tmp_path_factory.mktemp("tables")
    dirs = []
    for i, (torch_losses, mean, _) in enumerate([*VERDICTS, (None, None, None)]):
        runs = FP32_CASE if torch_losses is None else [
            *(_run("torch-adamw", k, x) for k, x in enumerate(torch_losses)),
            _run("int8-moments", 0, mean)]  # fmt: skip
        dirs.append(tmp / str(i))
        dirs[-1].mkdir()
        (dirs[-1] / "quality.json").write_text(json.dumps(_results(runs)))
    done = _quality(*(["--out", str(d), "--table-only"] for d in dirs))
    assert all(rc == 0 for rc, _, _ in done), [err for _, _, err in done]
    return [table for _, table, _ in done]


@pytest.mark.parametrize("torch_losses, mean, verdict", VERDICTS)
def test_quality_verdict_is_within_max_of_two_std_and_the_range(
    torch_losses, mean, verdict, tables
):
    text = tables[next(i for i, case in enumerate(VERDICTS) if case[0] is torch_losses)]
    assert _row(text, "int8-moments")[6] == verdict
    # bf16 params: torch's AdamW keeps bf16 moments and no master, and the footer says so
    assert ("torch-adamw on bf16 params: bf16 weights and moments, no fp32 master" in text) == bool(
        torch_losses
    )


FP32_CASE = [_run("torch-adamw", 0, 2.0), _run("torch-adamw", 1, 2.5), _run("fp32", 0, 1.0),
             _run("fp32", 1, 1.5), _run("int8-moments", 0, 1.375), _run("bf16-sr", 0, 2.25)]  # fmt: skip


def test_quality_judges_each_setting_against_fp32_too(tables):
    """torch-adamw on bf16 params keeps no fp32 master; the last two columns judge a setting
    against HybridAdamW's fp32 default with the same rule."""
    text = tables[-1]
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


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    """Each bad command line's (exit status, last line of stderr, whether --out exists)."""
    tmp = tmp_path_factory.mktemp("usage")
    dirs = [tmp / str(i) for i in range(len(BAD))]
    done = _quality(*([*argv, "--device", "cpu", "--out", str(d)]
                      for (argv, _), d in zip(BAD, dirs, strict=True)))  # fmt: skip
    return {" ".join(argv): (rc, (err.strip().splitlines() or [""])[-1], d.exists())
            for ((argv, _), d, (rc, _, err)) in zip(BAD, dirs, done, strict=True)}  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_quality_checks_its_options_before_anything_is_run(argv, message, usage):
    rc, line, out_made = usage[" ".join(argv)]
    assert rc == 2, line
    assert line.startswith(f"error: {message}", line.index("error: ")), line
    assert not out_made  # nor the corpus written into it


def _commands(results: dict) -> dict[tuple[str, int], list[str]]:
    """Each run's train command, without a taskset prefix."""
    out = {}
    for r in results["runs"]:
        cmd = shlex.split(r["command"])
        out[r["setting"], r["seed"]] = cmd[3:] if cmd[0] == "taskset" else cmd
    return out


def test_quality_seeds_go_to_the_seeds_for_settings_only(tmp_path):
    [(rc, _, progress)] = _quality(["--device", "cpu", "--seeds", "2", "--out", str(tmp_path)],
                                   prelude=fake_runs({}))  # fmt: skip
    assert rc == 0, progress
    results = json.loads((tmp_path / "quality.json").read_text())
    args = results["args"]
    assert args["settings"] == ["torch-adamw", "fp32", "bf16-moments", "int8-moments", "bf16-sr",
                                "bf16-sr+int8"]  # fmt: skip
    assert args["eval_every"] == args["steps"] == 2000
    assert [(r["setting"], r["seed"]) for r in results["runs"]] == [
        ("torch-adamw", 0), ("torch-adamw", 1), ("fp32", 0), ("fp32", 1), ("bf16-moments", 0),
        ("int8-moments", 0), ("int8-moments", 1), ("bf16-sr", 0), ("bf16-sr+int8", 0),
        ("bf16-sr+int8", 1)]  # fmt: skip
    commands = _commands(results)
    cmd = commands["bf16-sr+int8", 1]
    assert cmd[1:4] == ["-m", "offloadopt", "train"]
    assert " ".join(cmd).endswith(
        "--seed 1 --no-progress --optimizer hybrid --master-weights bf16-sr --state-dtype int8 "
        "--offload-fraction 1.0"
    )
    assert "--offload-fraction" not in commands["torch-adamw", 0]


SEVENTEEN_CORES = """
import os, shutil
os.sched_getaffinity = lambda pid: set(range(2, 19))
shutil.which = lambda name: {taskset!r}
"""


def test_quality_gives_parallel_runs_disjoint_cores(tmp_path):
    """P runs each sized to every core oversubscribe the host (two tiny CPU runs on 2 cores:
    0.5 s a step became 3 s): each slot gets its own slice."""
    four = ["--settings", "torch-adamw,fp32", "--seeds", "2", "--device", "cpu"]  # four runs
    cores = {}
    for taskset in ("/usr/bin/taskset", None):
        prelude = SEVENTEEN_CORES.format(taskset=taskset) + fake_runs({})
        folder = "taskset" if taskset else "none"
        argvs = [[*four, "--parallel", str(p), "--out", str(tmp_path / f"{folder}-{p}")]
                 for p in (4, 1, 18)]  # fmt: skip
        for (rc, _, err), p in zip(_quality(*argvs, prelude=prelude), (4, 1, 18), strict=True):
            assert rc == 0, err
            results = json.loads((tmp_path / f"{folder}-{p}" / "quality.json").read_text())
            cores[taskset, p] = sorted(r["cores"] or [] for r in results["runs"])
    assert cores["/usr/bin/taskset", 4] == [[2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13],
                                            [14, 15, 16, 17]]  # fmt: skip
    assert cores["/usr/bin/taskset", 1] == cores["/usr/bin/taskset", 18] == [[]] * 4
    assert cores[None, 4] == [[]] * 4  # no taskset: the runs share every core


def test_quality_ctrl_c_starts_no_queued_run(tmp_path):
    argv = ["--device", "cpu", "--settings", "torch-adamw,fp32,bf16-sr", "--out", str(tmp_path)]
    [(rc, _, err)] = _quality(argv, prelude=fake_runs({}, interrupt=True))
    started = [line.split()[1] for line in err.splitlines() if line.startswith("started ")]
    assert rc == 130 and started == ["torch-adamw-seed0"] and "interrupted" in err
