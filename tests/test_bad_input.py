"""Bad input to the commands: one ``offloadopt: error:`` line, a non-zero status, nothing built
and nothing half written. Each case a new user found, then a property test over every flag."""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadopt import cli
from offloadopt.cli import main
from offloadopt.harness import anchors, audit_job, bench, checks, models, train
from offloadopt.harness.bench import BenchConfig
from offloadopt.harness.checks import UsageError
from offloadopt.harness.train import TrainConfig


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An empty file, a 200-byte text, a plain file, an empty and a non-empty folder."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "empty.txt").write_bytes(b"")
    (d / "small.txt").write_bytes(b"some text " * 20)
    (d / "afile").write_text("x")
    (d / "emptydir").mkdir()
    (d / "fulldir").mkdir()
    (d / "fulldir" / "kept").write_text("x")
    return d


@contextlib.contextmanager
def nothing_built():
    """Building a model is a test failure: every check must come before it."""
    boom = AssertionError("got past the checks: a model was built")
    with (
        mock.patch.object(train, "make_model_and_optimizer", side_effect=boom),
        mock.patch.object(models, "build_model", side_effect=boom),
        mock.patch.object(audit_job, "GPT", side_effect=boom),
    ):
        yield


def run_cli(argv):
    """main(argv) in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), nothing_built():
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def one_error_line(argv, status=2):
    code, out, err = run_cli(argv)
    assert code == status, (argv, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("offloadopt: error: "), err
    return err.removeprefix("offloadopt: error: ").rstrip("\n")


# --- the cases of the issue, each with the exact line it now prints -----------------------------

NO_CUDA = "torch sees no CUDA device here (try --device cpu)"
CASES = [
    (["train", "--device", "foo"], "--device: 'foo' is not a device (cpu, cuda or cuda:N)"),
    (["bench", "--device", "foo"], "--device: 'foo' is not a device (cpu, cuda or cuda:N)"),
    (["audit", "--device", "foo"], "--device: 'foo' is not a device (cpu, cuda or cuda:N)"),
    (["train", "--device", "CUDA"],
     "--device: 'CUDA' is not a device (cpu, cuda or cuda:N); did you mean 'cuda'?"),
    (["audit", "--device", "cpu:1"], "--device: 'cpu:1' is not a device (cpu, cuda or cuda:N)"),
    (["audit", "--batch-size", "0"], "--batch-size: 0 is not an integer >= 1"),
    (["audit", "--seq-len", "0"], "--seq-len: 0 is not an integer >= 1"),
    (["audit", "--seq-len", "129"], "--seq-len: 129 is more than the tiny preset's block_size 128"),
    (["bench", "--fractions", "0", "2"], "--fractions: 2.0 is not in [0, 1]"),
    (["bench", "--fractions", "-1"], "--fractions: -1.0 is not in [0, 1]"),
    (["bench", "--steps", "0"], "--steps: 0 is not an integer >= 1"),
    (["bench", "--warmup", "-1"], "--warmup: -1 is not an integer >= 0"),
    (["bench", "--batch-size", "0"], "--batch-size: 0 is not an integer >= 1"),
    (["bench", "--lr", "-1"], "--lr: -1.0 is not a finite number >= 0"),
    (["bench", "--preset", "tiny", "--seq-len", "129"],
     "--seq-len: 129 is more than the tiny preset's 128"),
    (["audit", "--steps", "0"], "--steps: 0 is not an integer >= 1"),
    (["train", "--optimizer", "adamw", "--offload-fraction", "0.5"], "--offload-fraction 0.5: HybridAdamW's option; --optimizer adamw keeps everything on the device (it would be ignored)"),
    (["train", "--optimizer", "adamw", "--min-offload-numel", "5"], "--min-offload-numel 5: HybridAdamW's option; --optimizer adamw keeps everything on the device (it would be ignored)"),
    (["train", "--fsdp", "--state-dtype", "int8"], "--state-dtype int8 with --fsdp: compressed optimizer state does not support FSDP2 params yet (its block scales are not laid out like the shards); use --ddp, or leave out --state-dtype and --master-weights"),
    (["train", "--master-weights", "bf16-sr", "--dtype", "fp32"], "--master-weights bf16-sr with --dtype fp32: bf16-sr makes the bf16 weights their own masters; give --dtype bf16 (fp32 params would keep fp32 updates, fp16 params are refused)"),
    (["train", "--delay-after", "3"], "--delay-after: the synchronous steps before the delayed update, so it needs --overlap delayed (not 'step')"),
    (["train", "--delay-after", "-1"], "--delay-after: -1 is not an integer >= 0"),
    (["train", "--speculate"], "--speculate: starts clipped updates during backward, so it needs --optimizer hybrid, --overlap backward and a --grad-clip above 0, without --release-grads (got --optimizer hybrid, --overlap step, --grad-clip 1)"),
    (["train", "--speculate", "--overlap", "backward", "--grad-clip", "0"], "--speculate: starts clipped updates during backward, so it needs --optimizer hybrid, --overlap backward and a --grad-clip above 0, without --release-grads (got --optimizer hybrid, --overlap backward, --grad-clip 0)"),
    (["audit", "--overlap", "backward", "--optimizer", "adamw"], "--overlap backward: HybridAdamW's overlap modes need --optimizer hybrid"),
    (["audit", "--steps", "-1"], "--steps: -1 is not an integer >= 1"),
    (["train", "--grad-clip", "-1"], "--grad-clip: -1.0 is not a finite number >= 0"),
    (["train", "--grad-clip", "nan"], "--grad-clip: nan is not a finite number >= 0"),
    (["train", "--steps", "-1"], "--steps: -1 is not an integer >= 1"),
    (["train", "--grad-accum", "0"], "--grad-accum: 0 is not an integer >= 1"),
    (["train", "--grad-accum", "-2"], "--grad-accum: -2 is not an integer >= 1"),
    (["train", "--grad-accum", "1.5"], "--grad-accum: '1.5' is not an integer >= 1"),
    (["train", "--grad-accum", "four"], "--grad-accum: 'four' is not an integer >= 1"),
    (["train", "--grad-accum", "1000000"],
     "--grad-accum: '1000000' is too large (at most 65,536 micro-batches a step)"),
    # 10**11 was taken, and the first evaluation never ended (a new user's find)
    (["train", "--eval-batches", "100000000000"],
     "--eval-batches: '100000000000' is too large (at most 65,536 batches an evaluation)"),
    (["train", "--measure-fwd-bwd", "-1"], "--measure-fwd-bwd: -1 is not an integer >= 0"),
    # 2**63 - 1 was taken, and the run never reached its first step (a new user's find)
    (["train", "--measure-fwd-bwd", str(2**63 - 1)],
     f"--measure-fwd-bwd: '{2**63 - 1}' is too large (at most 65,536 steps)"),
    (["train", "--seed", str(2**70)], f"--seed: {2**70} is too large (at most 2**63 - 1)"),
    (["train", "--data", "empty.txt"], "--data: 'empty.txt': empty file (0 bytes)"),
    (["bench", "--data", "/dev/null"],
     "--data: '/dev/null' is no regular file (a device, a pipe or a socket): give a file"),
    # /dev/zero was read until the OOM killer ended the run (a new user's find)
    (["train", "--data", "/dev/zero"],
     "--data: '/dev/zero' is no regular file (a device, a pipe or a socket): give a file"),
    (["train", "--data", "small.txt"],
     "--data: 'small.txt': 200 bytes give a held-out split of 20 tokens, fewer than --seq-len + 1 "
     "= 129 (use at least 1,290 bytes of text, or a smaller --seq-len)"),
    (["train", "--data", "missing.txt"], "--data: 'missing.txt': no such file"),
    (["audit", "--json", "nodir/x.json"], "--json: 'nodir/x.json': no folder 'nodir'"),
    (["bench", "--out", "afile"], "--out: 'afile' exists and is not a folder"),
    (["bench", "--out", "afile/sub"], "--out: 'afile/sub': 'afile' is not a folder"),
    (["audit", "--trace", "emptydir"], "--trace: 'emptydir' is a folder, not a file name"),
    (["train", "--save", "emptydir"],
     "--save emptydir is an empty folder; --checkpoint-format file writes one file (give a file name, or --checkpoint-format streamed)"),
    (["audit", "--trace", "fulldir"], "--trace: 'fulldir' is a folder, not a file name"),
    (["train", "--save", "fulldir", "--checkpoint-format", "streamed"],
     "--save: 'fulldir' is a folder that holds files but no streamed checkpoint (no index.pt): "
     "give a file name, or a new or empty folder for --checkpoint-format streamed"),
    (["train", "--device", "cuda:99"],
     NO_CUDA if not torch.cuda.is_available() else f"torch sees {torch.cuda.device_count()}"),
    (["train", "--offload-fraction", "auto", "--overlap", "delayed"],
     "--offload-fraction auto with --overlap delayed: the fraction decides which params train on "
     "weights one step old, so one chosen from timings would make the results depend on them; "
     "give a number (1.0 is the delayed update's usual one), or, on a GPU, a --max-gpu-memory budget"),
    (["train", "--warmup-steps", "50", "--steps", "10"],
     "--warmup-steps: 50 is more than --steps 10 (the warm-up would never reach the peak --lr)"),
    (["audit", "--trace", "x.txt"],
     "--trace: 'x.txt' is not a .json or .json.gz file name (a Chrome trace is JSON)"),
    (["audit", "--trace", "x.json.txt"],
     "--trace: 'x.json.txt' is not a .json or .json.gz file name (a Chrome trace is JSON)"),
    (["train", "--max-gpu-memory", "-5GB"],  # not argparse's "expected one argument"
     "--max-gpu-memory: Invalid size: '-5GB' (expected bytes, or a number with one of B, KB, MB, "
     "GB, TB, KiB, MiB, GiB, TiB, like '120GB' or '112GiB')"),
    (["train", "--lr", "-1e-3"], "--lr: -0.001 is not a finite number >= 0"),
    (["train", "--max-gpu-memory"], "--max-gpu-memory: expected one argument"),
    (["train", "--max-gpu-memory", "--steps", "3"], "--max-gpu-memory: expected one argument"),
    # a fresh user's conflicts (2026-12-02): each flag was dropped silently
    (["train", "--mock-data", "--data", "small.txt"],
     "--mock-data with --data small.txt: random tokens replace the text (the file would be ignored); give one"),
    (["train", "--overlap", "delayed", "--delay-after", "100", "--steps", "20"],
     "--delay-after: 100 synchronous steps of --steps 20 leave none delayed (--overlap delayed would never start)"),
    (["audit", "--optimizer", "adamw", "--no-pin-memory"],
     "--no-pin-memory: HybridAdamW's option; --optimizer adamw would ignore it"),
    (["audit", "--optimizer", "adamw", "--offload-fraction", "0.3"],
     "--offload-fraction 0.3: --optimizer adamw has no fraction (it would be ignored)"),
    (["audit", "--mock-data", "--data", "small.txt"],
     "--mock-data with --data small.txt: random tokens replace the text (the file would be ignored); give one"),
]  # fmt: skip


@pytest.mark.parametrize("argv, line", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_each_found_case_is_one_line_and_status_2(files, monkeypatch, argv, line):
    monkeypatch.chdir(files)
    before = sorted(p.name for p in files.rglob("*"))
    got = one_error_line(argv)
    assert got == line or (argv[-1] == "cuda:99" and line in got)
    assert sorted(p.name for p in files.rglob("*")) == before  # nothing written, nothing moved
    assert (files / "emptydir").is_dir() and (files / "fulldir" / "kept").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_says_so(monkeypatch, files):
    monkeypatch.chdir(files)
    for command in ("train", "bench", "audit"):
        assert one_error_line([command, "--device", "cuda"]) == f"--device: 'cuda': {NO_CUDA}"


def test_an_hf_preset_without_transformers_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    out = tmp_path / "out"
    line = one_error_line(["bench", "--preset", "hf-gpt2-xl", "--out", str(out)])
    assert line == "--preset: 'hf-gpt2-xl' needs transformers (pip install transformers)"
    assert not out.exists()


def test_a_bench_that_fails_while_running_is_status_1_and_leaves_no_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with mock.patch.object(models, "build_model", side_effect=RuntimeError("CUDA out of memory")):
        code = main(["bench", "--out", str(out), "--no-progress", "--steps", "1"])
    assert code == 1 and not out.exists()


def test_bench_is_status_1_when_a_configuration_failed(monkeypatch, tmp_path, capsys):
    rows = [{"name": "hybrid:0", "status": "baseline"},
            {"name": "hybrid:0.5", "status": "error: RuntimeError: boom"},
            {"name": "torchao", "status": "skipped: torchao is not installed"}]  # fmt: skip
    monkeypatch.setattr(bench, "run_bench", lambda cfg: rows)
    assert main(["bench", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        "offloadopt: error: 1 of 3 configurations failed: hybrid:0.5 "
        "(their errors: the table, bench.json)\n"
    )
    monkeypatch.setattr(bench, "run_bench", lambda cfg: rows[::2])  # skipped is not failed
    assert main(["bench", "--out", str(tmp_path)]) == 0


def test_a_failure_while_running_is_one_line_status_1_and_the_env_var_shows_it(monkeypatch, capsys):
    def boom(cfg):
        raise RuntimeError("the kernel failed\nmore detail")

    monkeypatch.setattr(train, "train", boom)
    monkeypatch.delenv("OFFLOADOPT_TRACEBACK", raising=False)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == (
        "offloadopt: error: RuntimeError: the kernel failed [...] "
        "(OFFLOADOPT_TRACEBACK=1 shows the traceback)\n"
    )
    monkeypatch.setenv("OFFLOADOPT_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="the kernel failed"):
        main(["train"])


def test_a_library_error_starting_with_offloadopt_is_not_prefixed_twice(monkeypatch, capsys):
    # A user's find: "offloadopt: error: KernelBuildError: offloadopt: offloadopt's CPU kernel ..."
    from offloadopt.kernels import KernelBuildError

    def boom(cfg):
        raise KernelBuildError(
            "offloadopt: offloadopt's CPU kernel cannot be built in /x: it is a file"
        )

    monkeypatch.setattr(train, "train", boom)
    monkeypatch.delenv("OFFLOADOPT_TRACEBACK", raising=False)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == (
        "offloadopt: error: KernelBuildError: offloadopt's CPU kernel cannot be built in /x: it is a "
        "file (OFFLOADOPT_TRACEBACK=1 shows the traceback)\n"
    )


def test_interrupt_and_help(monkeypatch, capsys):
    monkeypatch.setattr(train, "train", mock.Mock(side_effect=KeyboardInterrupt))
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "offloadopt: interrupted\n"
    assert main(["audit", "--help"]) == 0
    assert "OFFLOADOPT_TRACEBACK=1" in capsys.readouterr().out
    assert one_error_line([]) == "the following arguments are required: COMMAND"
    assert one_error_line(["train", "--stepz", "3"]) == "unrecognized arguments: --stepz 3"


@pytest.mark.slow
def test_the_real_exit_status_and_stderr_of_the_console_command(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "offloadopt", "bench", "--fractions", "2", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (p.returncode, p.stdout, p.stderr) == (
        2, "", "offloadopt: error: --fractions: 2.0 is not in [0, 1]\n"
    )  # fmt: skip
    assert not (tmp_path / "o").exists()


# --- the same checks for Python callers ----------------------------------------------------------


def test_configs_built_in_python_are_checked_like_the_flags(tmp_path):
    with pytest.raises(UsageError, match=r"^--grad-clip: -1.0 is not a finite number >= 0$"):
        TrainConfig(grad_clip=-1).resolved()
    with pytest.raises(UsageError, match=r"^--steps: 0 is not an integer >= 1$"):
        TrainConfig(steps=0).resolved()  # not "Invalid warmup_steps" (0 // 20 was fine anyway)
    with pytest.raises(UsageError, match=r"^--grad-accum: 0 is not an integer >= 1$"):
        TrainConfig(grad_accum=0).resolved()
    with pytest.raises(UsageError, match=r"^--grad-accum: 2.0 is not an integer >= 1$"):
        TrainConfig(grad_accum=2.0).resolved()
    with pytest.raises(UsageError, match=r"^--device: 'meta' is not a device"):
        TrainConfig(device="meta").resolved()
    with pytest.raises(UsageError, match=r"^--lr: 'fast' is not a number$"):
        TrainConfig(lr="fast").resolved()
    cfg = BenchConfig(preset="tiny", device="cpu", out=str(tmp_path / "o"))
    assert bench.resolved(cfg).seq_len == 128  # was 1024: every configuration failed on a CPU
    with pytest.raises(UsageError, match=r"^--fractions: nan is not in \[0, 1\]$"):
        bench.run_bench(BenchConfig(preset="tiny", device="cpu", fractions=[math.nan],
                                    out=str(tmp_path / "o")))  # fmt: skip
    with pytest.raises(UsageError, match="--fractions: none given"):
        bench.resolved(BenchConfig(preset="tiny", device="cpu", fractions=[], out=str(tmp_path)))
    assert not (tmp_path / "o").exists()


def test_train_combinations_are_refused_before_the_data_is_loaded(monkeypatch):
    boom = AssertionError("got past the checks: the data was loaded")
    monkeypatch.setattr(checks, "text_data", mock.Mock(side_effect=boom))
    monkeypatch.setattr(train, "mock_data", mock.Mock(side_effect=boom))
    for argv in (["--offload-fraction", "auto", "--overlap", "delayed"],
                 ["--warmup-steps", "11", "--steps", "10", "--mock-data"],
                 ["--max-gpu-memory", "10GB"]):  # fmt: skip
        assert one_error_line(["train", *argv]).startswith(argv[0])


@pytest.mark.parametrize("name", ["OFFLOADOPT_UPDATE_THREAD", "OFFLOADOPT_DEVICE_STEP"])
@pytest.mark.parametrize("command", ["train", "bench", "audit"])
def test_a_bad_environment_setting_is_a_usage_error_before_the_data_is_loaded(
    monkeypatch, command, name
):
    """A user's trial: ``OFFLOADOPT_UPDATE_THREAD=yes offloadopt train`` read the data, then
    ended with status 1 from HybridAdamW's constructor; a bad flag is status 2 before that."""
    boom = AssertionError("got past the checks: the data was loaded")
    monkeypatch.setattr(checks, "text_data", mock.Mock(side_effect=boom))
    monkeypatch.setattr(train, "mock_data", mock.Mock(side_effect=boom))
    monkeypatch.setenv(name, "yes")
    assert one_error_line([command]).startswith(f"{name}='yes'; expected ")


@pytest.mark.parametrize("fraction", [[], ["--offload-fraction", "auto"]], ids=str)
def test_a_gpu_budget_on_a_run_without_a_gpu_is_refused(fraction):
    """A new user's finding: ``train --max-gpu-memory 10GB`` without a GPU was taken without a
    word: the CPU stood in for the GPU, and the budget chose a fraction that moved the state
    from host memory to host memory (and logged a "device" prediction)."""
    why = "--device cpu" if torch.cuda.is_available() else "torch sees no CUDA device here"
    assert one_error_line(["train", "--max-gpu-memory", "10GB", *fraction]) == (
        f"--max-gpu-memory 10.00 GB (9.31 GiB): a budget of GPU memory, and this run has no GPU "
        f"({why}); leave it out, or run on a GPU with --device cuda"
    )


def test_a_value_that_starts_like_a_negative_number_is_the_options_value(tmp_path, monkeypatch):
    from offloadopt.cli import build_parser

    monkeypatch.chdir(tmp_path)
    parse = build_parser().parse_args
    assert parse(["audit", "--trace", "x.json.gz"]).trace == "x.json.gz"
    assert parse(["audit", "--trace", "x.json"]).trace == "x.json"
    assert one_error_line(["train", "--data", "-1.txt"]) == "--data: '-1.txt': no such file"
    (tmp_path / "-1.txt").write_text("text " * 100)
    assert parse(["train", "--data", "-1.txt", "--steps", "2"]).data == "-1.txt"
    # an option of several values keeps argparse's reading; "--" too
    assert one_error_line(["bench", "--fractions", "0", "-.5", "1"]) == (
        "--fractions: -0.5 is not in [0, 1]"
    )
    assert parse(["bench", "--fractions", "0", "0.5"]).fractions == [0.0, 0.5]
    assert one_error_line(["train", "--", "--max-gpu-memory", "-5GB"]).startswith("unrecognized")


def test_bench_json_is_written_whole(tmp_path):
    path = tmp_path / "bench.json"
    checks.write_atomic(path, json.dumps({"a": 1}))
    with mock.patch.object(os, "replace", side_effect=OSError("disk full")):
        with pytest.raises(OSError):
            checks.write_atomic(path, json.dumps({"a": 2}))
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["bench.json"]


# --- property: any malformed value of any flag --------------------------------------------------

INT_MAX = 2**63 - 1
JUNK = ["", "abc", "1.5", "nan", "inf", "-inf", "1e3", "[1]", "None", "0x10", "3 steps", "\n"]


def ints_outside(lo, hi=INT_MAX):
    def valid(text):
        try:
            return lo <= int(text) <= hi
        except ValueError:
            return False

    numbers = st.integers(max_value=lo - 1) | st.integers(min_value=hi + 1, max_value=2**200)
    texts = (st.sampled_from(JUNK) | st.text(max_size=6)).filter(lambda t: not valid(t))
    return numbers.map(str) | texts


def floats_outside(ok):
    def valid(text):
        try:
            return ok(float(text))
        except ValueError:
            return False

    numbers = st.floats().filter(lambda x: not ok(x)).map(repr)
    return numbers | (st.sampled_from(JUNK + ["1e400"]) | st.text(max_size=6)).filter(
        lambda t: not valid(t)
    )


def choice_outside(choices):
    return (st.sampled_from(["", "x", "TINY", "Hybrid"]) | st.text(max_size=8)).filter(
        lambda t: t not in choices
    )


def device_outside():
    def valid(text):
        m = re.fullmatch(r"cuda(?::(\d+))?", text)
        n = torch.cuda.device_count()
        return text in ("cpu", "cpu:0") or (m is not None and n > 0 and int(m[1] or 0) < n)

    named = [
        "foo",
        "CUDA",
        "Cpu",
        "",
        "meta",
        "mps",
        "cpu:1",
        "cuda:99",
        "cuda:-1",
        "cuda:x",
        "xla",
    ]
    return (st.sampled_from([*named, "cuda"]) | st.text(max_size=8)).filter(lambda t: not valid(t))


POS, NONNEG = ints_outside(1), ints_outside(0)
FRACTION = floats_outside(lambda x: 0 <= x <= 1)
NONNEG_FLOAT = floats_outside(lambda x: 0 <= x < math.inf)
DATA = st.sampled_from(["", "missing.txt", "emptydir", "empty.txt", "/dev/null", "small.txt"])
OUT_FILE = st.sampled_from(["", "emptydir", "fulldir", "nodir/x.json", "afile/x.json"])
FLAGS = {
    "train": {
        "--device": device_outside(), "--preset": choice_outside(train.PRESETS),
        "--optimizer": choice_outside(train.OPTIMIZERS), "--offload-fraction": FRACTION,
        "--min-offload-numel": NONNEG, "--steps": POS, "--batch-size": POS,
        "--seq-len": POS | st.integers(129, 10**6).map(str), "--lr": NONNEG_FLOAT,
        "--warmup-steps": NONNEG, "--weight-decay": NONNEG_FLOAT, "--grad-clip": NONNEG_FLOAT,
        "--seed": NONNEG, "--dtype": choice_outside(train.DTYPES), "--data": DATA,
        "--eval-every": POS, "--eval-batches": POS, "--log-every": POS,
        "--overlap": choice_outside(train.OVERLAPS),
        "--mock-data": st.just("1"), "--no-progress": st.just("yes"),
    },
    "bench": {
        "--preset": choice_outside(models.MODEL_PRESETS), "--device": device_outside(),
        "--dtype": choice_outside(bench.DTYPES), "--batch-size": POS,
        "--seq-len": POS | st.integers(1025, 10**6).map(str), "--warmup": NONNEG, "--steps": POS,
        "--slow-steps": POS, "--lr": NONNEG_FLOAT, "--fractions": FRACTION,
        "--anchors": choice_outside(anchors.ANCHORS), "--data": DATA, "--seed": NONNEG,
        "--overlap": choice_outside(anchors.MODES), "--modes": choice_outside(anchors.MODES),
        "--out": st.sampled_from(["", "afile", "afile/sub"]), "--no-kernel": st.just("0"),
    },
    "audit": {
        "--device": device_outside(), "--preset": choice_outside(audit_job.PRESETS),
        "--dtype": choice_outside(audit_job.DTYPES),
        "--optimizer": choice_outside(audit_job.OPTIMIZERS), "--offload-fraction": FRACTION,
        "--steps": POS, "--warmup": NONNEG, "--batch-size": POS,
        "--seq-len": POS | st.integers(129, 10**6).map(str), "--lr": NONNEG_FLOAT,
        "--seed": NONNEG, "--data": DATA, "--trace": OUT_FILE, "--json": OUT_FILE,
        "--no-pin-memory": st.just("1"), "--overlap": choice_outside(anchors.MODES),
        "--mode": choice_outside(anchors.MODES),
    },
}  # fmt: skip
for _flags in FLAGS.values():  # every command takes the output options (offloadopt/cli.py)
    _flags.update({"--log-level": choice_outside(cli.LOG_LEVELS), "--quiet": st.just("1")})
TAKES_NOTHING = {"--mock-data", "--no-progress", "--no-kernel", "--no-pin-memory", "--anchors",
                 "--quiet"}  # fmt: skip


@pytest.mark.parametrize("command", list(FLAGS))
@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data())
def test_any_malformed_value_of_any_flag_is_one_line_and_status_2(files, command, data):
    flag = data.draw(st.sampled_from(sorted(FLAGS[command])), label="flag")
    missing = flag not in TAKES_NOTHING and data.draw(st.booleans(), label="value left out")
    value = data.draw(FLAGS[command][flag], label="value")
    argv = [command, flag] if missing else [command, f"{flag}={value}"]
    cwd = os.getcwd()
    os.chdir(files)  # the paths above are relative to it
    try:
        line = one_error_line(argv)
    finally:
        os.chdir(cwd)
    assert line.startswith(flag) and "Traceback" not in line, line


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "argv", [["bench", "--out", "/proc/x"], ["audit", "--json", "/proc/x.json"],
             ["audit", "--trace", "/proc/x.json"]],
)  # fmt: skip
def test_a_folder_nobody_can_write_in_is_a_usage_error_before_anything_runs(argv):
    """/proc passes os.access() for root but takes no new file: the check tries one (it used
    to fail after the run, with status 1; a fresh user's finding)."""
    err = one_error_line(argv)
    assert err.startswith(f"{argv[1]}: '{argv[2]}': cannot write in '/proc'"), err


@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs Linux's /proc")
@pytest.mark.parametrize("fmt", ["file", "streamed"])
def test_a_save_onto_a_file_of_proc_says_why_before_training(fmt):
    """A user's find: ``train --save /proc/version`` (there, a "regular" file to stat, and root
    passes access()) said "cannot write in '/proc' (No such file or directory)"."""
    assert one_error_line(["train", "--save", "/proc/version", "--checkpoint-format", fmt]) == (
        "--save: '/proc/version': cannot write in '/proc' (a pseudo file system, as /proc and "
        "/sys: it shows the kernel's files and stores none)"
    )


@pytest.mark.slow
def test_sigterm_stops_train_as_ctrl_c_does_and_keeps_its_log(tmp_path):
    """A fresh user's finding: SIGTERM (what schedulers, Docker and torchrun send) killed
    ``offloadopt train`` at once (status -15, no message), and the step lines a redirected
    stdout still held in its buffer were lost. It is now handled as Ctrl-C is: status 143, one
    line saying so, and every step line printed is in the file."""
    import signal
    import time

    log = tmp_path / "train.log"

    def steps_logged() -> list[int]:
        whole = log.read_text().split("\n")[:-1]  # complete lines only: the file is being written
        return [int(line.split()[1].split("/")[0]) for line in whole if line.startswith("step ")]

    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offloadopt", "train", "--preset", "tiny", "--steps", "100000",
             "--log-every", "1", "--eval-every", "100000", "--no-progress"],
            stdout=out, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while len(steps_logged()) < 3:  # lines reach the file as they are logged
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().endswith("offloadopt: terminated (SIGTERM)")
    steps = steps_logged()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3


def test_save_never_replaces_a_file_that_is_no_checkpoint(tmp_path):
    # a new user's finding: --save over the --data file, or over any text file, replaced it
    # with a checkpoint and exited 0
    text = tmp_path / "d.txt"
    text.write_bytes(b"some training text " * 200)
    want = text.read_bytes()
    line = one_error_line(["train", "--steps", "3", "--data", str(text), "--save", str(text)])
    assert line == f"--save {text} is the --data file; give another name"
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    line = one_error_line(["train", "--steps", "3", "--save", str(notes)])
    assert line == (f"--save {notes}: a file that is not a checkpoint is there, and a save "
                    "would replace it; give another name, or move it away")  # fmt: skip
    assert text.read_bytes() == want and notes.read_text() == "mine"


def test_a_model_or_batch_larger_than_the_host_is_refused_before_the_build():
    # gpt-40b on the CPU built for 78 s until the kernel's OOM killer ended it (status 137);
    # a batch of 1e8 sequences failed in the allocator with status 1
    line = one_error_line(["train", "--preset", "gpt-40b", "--device", "cpu", "--steps", "1"])
    assert line.startswith("--preset gpt-40b: its weights alone are 160.32 GB"), line
    line = one_error_line(["train", "--steps", "2", "--batch-size", "100000000"])
    assert line.startswith("--batch-size 100000000: one micro-batch's logits alone are"), line


def test_auto_with_too_few_steps_is_refused_and_the_count_is_autos_own():
    """A new user's find: ``--offload-fraction auto --steps 3`` trained, then said at its end
    that auto chose nothing. Now it is refused up front; the step count the message names is
    the one auto's phases add up to, and a run of that many steps ends on auto's choice."""
    from offloadopt.harness.options import AUTO_CHOICE_STEPS
    from offloadopt.place import auto

    assert AUTO_CHOICE_STEPS == (1 + auto.MEASURED_STEPS) + (
        1 + auto.SETTLE_STEPS + auto.MEASURED_STEPS
    )
    line = one_error_line(["train", "--offload-fraction", "auto", "--steps", "3"])
    assert line == (
        "--offload-fraction auto with --steps 3: auto measures its first 10 steps before its choice "
        "is in force, so this run would end on a fraction nobody chose; give --steps 10 or more, or a number"
    )
    one_error_line(["train", "--offload-fraction", "auto", "--steps", str(AUTO_CHOICE_STEPS - 1)])


@pytest.mark.slow
def test_a_run_of_autos_step_count_ends_on_its_choice(recwarn):
    """The least --steps the refusal above lets through ends on a fraction auto chose (no
    "chose no fraction" warning, nothing "kept")."""
    from offloadopt.harness import train
    from offloadopt.harness.options import AUTO_CHOICE_STEPS, TrainConfig

    out = train.train(TrainConfig(steps=AUTO_CHOICE_STEPS, batch_size=2, seq_len=16, eval_every=100,
                                  eval_batches=1, offload_fraction="auto"))  # fmt: skip
    choice = out["placement_choice"]
    assert choice["set_by"] == "auto" and "kept" not in choice and "unmeasured" not in choice, (
        choice
    )
    assert not [w for w in recwarn if "chose no fraction" in str(w.message)]


def test_output_paths_that_are_no_regular_files_are_refused_and_left_as_they_are(
    tmp_path, monkeypatch
):
    """A new user's find: ``train --save`` and ``audit --json`` / ``--trace`` onto a device
    (``/dev/null``, as root), a FIFO or a link to one replaced the node with a regular file,
    status 0. A FIFO stands in for the device here."""
    import stat

    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    os.mkfifo("fifo.json")
    os.symlink("fifo", "link")
    cases = [["train", "--save", "fifo"], ["train", "--save", "link"],
             ["train", "--save", "fifo", "--checkpoint-format", "streamed"],
             ["audit", "--json", "fifo"], ["audit", "--json", "link"], ["audit", "--trace", "fifo.json"]]  # fmt: skip
    for argv in cases:
        path = argv[2]
        assert one_error_line(argv) == (
            f"{argv[1]}: {path!r} is no regular file (a device, a pipe or a socket), and a write "
            "would replace it: give a file name"
        )
    for name in ("fifo", "fifo.json"):
        assert stat.S_ISFIFO(os.lstat(name).st_mode)
    assert os.path.islink("link")


def test_a_save_through_a_dangling_link_is_refused_before_training(tmp_path, monkeypatch):
    """A new user's find: ``--save link`` where the link's target's folder does not exist
    passed the checks, trained the whole run, then failed to save it (a raw
    FileNotFoundError, status 1; the streamed format named the wrong folder)."""
    monkeypatch.chdir(tmp_path)
    os.symlink("/nonexistent/zzz", "dangling")
    for fmt in ("file", "streamed"):
        argv = ["train", "--save", "dangling", "--checkpoint-format", fmt]
        assert one_error_line(argv) == (
            "--save: 'dangling' is a link to '/nonexistent/zzz', whose folder '/nonexistent' "
            "does not exist"
        )
    assert one_error_line(["audit", "--json", "dangling"]).endswith(
        "is a link to '/nonexistent/zzz', whose folder '/nonexistent' does not exist"
    )
    assert os.path.islink("dangling") and not os.path.exists("/nonexistent")


def test_audit_outputs_replace_only_files_of_their_own_kind(tmp_path, monkeypatch):
    """A new user's find: ``audit --json ck.pt`` replaced a checkpoint with JSON, status 0. An
    existing file is replaced only where it is a JSON report (``--json``) or a Chrome trace
    (``--trace``, gzipped for ``.json.gz``)."""
    import gzip

    monkeypatch.chdir(tmp_path)
    Path("ck.pt").write_bytes(b"PK\x03\x04 a checkpoint")
    Path("old.json").write_text('{"report": 1}')
    Path("notes.json").write_text("notes, not JSON")
    Path("trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))
    Path("plain.json.gz").write_text('{"traceEvents": []}')
    for argv, what in ((["audit", "--json", "ck.pt"], "a JSON report"),
                       (["audit", "--json", "notes.json"], "a JSON report"),
                       (["audit", "--trace", "plain.json.gz"], "a Chrome trace")):  # fmt: skip
        assert one_error_line(argv) == (
            f"{argv[1]}: {argv[2]!r}: a file that is not {what} is there, and the write would "
            "replace it; give another name, or move it away"
        )
    assert Path("ck.pt").read_bytes() == b"PK\x03\x04 a checkpoint"
    from offloadopt.harness import checks

    assert checks.json_output_file("old.json") == "old.json"  # a report of its kind: replaced
    assert checks.chrome_trace_file("trace.json.gz") == "trace.json.gz"
    assert checks.json_output_file("new.json") == "new.json"


def test_a_written_file_keeps_the_symlink_that_named_it(tmp_path):
    """A new user's find: ``train --save latest.pt`` (file format), with latest.pt a symlink
    to run1.pt, made latest.pt a regular file and left run1.pt stale; save_streamed and now
    every write (the checkpoint file, audit's JSON) go where the link points."""
    from offloadopt.harness import checks

    (tmp_path / "run1.json").write_text("{}")
    (tmp_path / "latest.json").symlink_to("run1.json")
    checks.write_atomic(tmp_path / "latest.json", '{"new": 1}')
    assert (tmp_path / "latest.json").is_symlink()
    assert (tmp_path / "run1.json").read_text() == '{"new": 1}'
    ck, latest = tmp_path / "run1.pt", tmp_path / "latest.pt"
    argv = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--quiet"]  # fmt: skip
    assert main([*argv, "--save", str(ck)]) == 0
    latest.symlink_to("run1.pt")
    first = ck.read_bytes()
    assert main([*argv, "--seed", "1", "--save", str(latest)]) == 0  # another run, same link
    assert latest.is_symlink() and ck.read_bytes() != first
    assert torch.load(ck, weights_only=False)["config"]["seed"] == 1


def test_a_read_only_mount_is_named_as_one(tmp_path, monkeypatch):
    """A new user's find: ``--save`` onto a read-only mount said "permission denied"; the
    mount's flag is read, and a folder whose permissions refuse says what it said."""
    from types import SimpleNamespace

    from offloadopt.harness import checks

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    out = str(tmp_path / "ck.pt")
    with pytest.raises(checks.UsageError, match=r"\(permission denied\)"):
        checks.output_file(out)
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(checks.UsageError, match=r"cannot write in .* \(read-only file system\)"):
        checks.output_file(out)


def test_a_streamed_checkpoint_whose_index_is_no_file_is_called_damaged(tmp_path, monkeypatch):
    """A new user's find: a checkpoint folder whose index.pt was a link to /dev/zero (or a
    folder) was refused as "no index.pt"; it is there, and damaged. Then it lacked the advice
    the other damage messages give (nothing was changed, what to do): it has it now."""
    monkeypatch.chdir(tmp_path)
    for name, make in (("dev", lambda p: p.symlink_to("/dev/zero")), ("dir", Path.mkdir),
                       ("gone", lambda p: p.symlink_to(tmp_path / "nowhere"))):  # fmt: skip
        (tmp_path / name).mkdir()
        make(tmp_path / name / "index.pt")
        assert one_error_line(["train", "--resume", name]) == (
            f"--resume: {name!r}: its index.pt is no regular file (a link to a device, a folder "
            "or a missing file): the checkpoint is damaged; nothing was changed: restore the "
            "folder from a copy, or load an earlier checkpoint"
        )
    (tmp_path / "plain").mkdir()
    assert one_error_line(["train", "--resume", "plain"]) == (
        "--resume: 'plain' is a folder but no streamed checkpoint (no index.pt)"
    )


def test_a_streamed_checkpoint_whose_part_is_no_file_names_the_part_as_damaged(
    tmp_path, monkeypatch
):
    """A user's find: a checkpoint folder whose part file was replaced by a folder (or a link
    to a device) said it "lacks part files"; the part is there, no regular file: damaged."""
    import shutil

    monkeypatch.chdir(tmp_path)
    argv = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--quiet"]
    assert main([*argv, "--save", "ck", "--checkpoint-format", "streamed"]) == 0
    for name, make in (("dir", Path.mkdir), ("dev", lambda p: p.symlink_to("/dev/zero"))):
        shutil.copytree("ck", name)
        part = Path(name) / "part-00000.pt"
        part.unlink()
        make(part)
        assert one_error_line([*argv, "--resume", name]) == (
            f"--resume: part-00000.pt of {name!r} is no regular file (a folder, a "
            "link to a device or a missing file): the checkpoint is damaged; nothing was "
            "changed: restore the folder from a copy, or load an earlier checkpoint"
        )
    shutil.rmtree("dir/part-00000.pt")  # missing: as before
    assert "'dir' lacks part files [0]" in one_error_line([*argv, "--resume", "dir"])
