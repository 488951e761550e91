"""What the commands print besides their results: ``--log-level`` and ``--quiet``, the progress
bar only on a terminal (tqdm's ``disable=None``), and what a run on the CPU alone measures
(``bench`` and ``audit`` say it instead of figures that would read as findings)."""

from __future__ import annotations

import io
import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from offloadopt.cli import main
from offloadopt.harness import provenance

TRAIN = ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
         "--log-every", "1", "--optimizer", "adamw"]  # fmt: skip


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("flags", [["--quiet"], ["-q"], ["--log-level", "warning"]])
def test_quiet_and_warning_level_print_only_the_result(capsys, flags):
    assert main([*TRAIN, *flags]) == 0
    out, err = capsys.readouterr()
    lines = _lines(out)
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 3, out  # the JSON line alone
    assert err == ""
    assert logging.getLogger("offloadopt").level == logging.NOTSET  # as it was before main


def test_the_default_level_logs_every_step(capsys):
    assert main([*TRAIN, "--no-progress"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert sum(line.startswith("step ") for line in lines) == 3, lines
    assert json.loads(lines[-1])["steps"] == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_on_a_terminal_only(capsys, monkeypatch):
    assert main(TRAIN) == 0  # pytest's stderr is no terminal: no tqdm frames in a log
    assert "train:" not in capsys.readouterr().err
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(TRAIN) == 0
    assert "train:" in terminal.getvalue() and "3/3" in terminal.getvalue()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*TRAIN, "--quiet"]) == 0  # --quiet: no bar on a terminal either
    assert "train:" not in terminal.getvalue()


def test_audit_takes_no_progress_as_train_and_bench_do(capsys, monkeypatch):
    # A user's find: audit refused --no-progress (a script passing it to all three commands)
    audit = ["audit", "--device", "cpu", "--steps", "2", "--warmup", "1", "--batch-size", "2",
             "--seq-len", "16"]  # fmt: skip
    for flags, shown in (([], True), (["--no-progress"], False), (["--quiet"], False)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main([*audit, *flags]) == 0, terminal.getvalue()
        bar = "audit:" in terminal.getvalue() and "3/3" in terminal.getvalue()
        assert bar == shown, (flags, terminal.getvalue())
        assert json.loads(_lines(capsys.readouterr().out)[-1])["iterations"] == 2


def test_an_audit_on_the_cpu_says_what_it_measures(capsys):
    assert main(["audit", "--device", "cpu", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert provenance.CPU_AUDIT_NOTE in out
    assert "0 copies" not in out and "Operation" not in out  # no empty table to misread
    summary = json.loads(_lines(out)[-1])
    assert summary["device"] == "cpu" and summary["measures"] == provenance.CPU_AUDIT_NOTE


@pytest.mark.slow
def test_a_bench_on_the_cpu_says_what_it_measures_and_where_it_ran(capsys, tmp_path):
    argv = ["bench", "--device", "cpu", "--preset", "tiny", "--batch-size", "2", "--seq-len",
            "16", "--warmup", "0", "--steps", "1", "--fractions", "1", "--anchors", "--no-kernel",
            "--no-audit", "--out", str(tmp_path), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"bench {provenance.CPU_BENCH_NOTE}" in out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["measures"] == provenance.CPU_BENCH_NOTE
    assert saved["cpu"] == provenance.cpu_name() and "cores)" in saved["cpu"]
    assert saved["commit"] == provenance.commit()  # this checkout's, or None outside one
    assert saved["versions"]["torch"]


def test_the_commit_is_none_outside_a_checkout(tmp_path):
    assert provenance.commit(tmp_path) is None


def test_ctrl_c_while_the_options_are_checked_is_one_line_and_130(capsys, monkeypatch):
    """A new user's find: Ctrl-C in the first second (argparse checking the options, which
    imports torch) printed a 53-line KeyboardInterrupt traceback instead of the one line and
    status 130 that an interrupt later in the run gives."""
    import argparse

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", interrupted)
    try:
        status = main(["train", "--steps", "2"])
    except KeyboardInterrupt:  # not raised on: it would stop the whole test session
        pytest.fail("the interrupt escaped main()")
    assert status == 130
    assert capsys.readouterr().err == "offloadopt: interrupted\n"


def test_a_warning_during_a_command_is_one_line_without_the_scripts_place(capsys, monkeypatch):
    """A new user's find: ``offloadopt train`` printed an offloadopt warning as
    ``/.../bin/offloadopt:8: UserWarning: ...`` and then the line ``sys.exit(main())`` (the
    warning points past the library at its caller, which under the CLI is the script or
    ``<frozen runpy>``). Now it is one ``offloadopt: warning:`` line; a warning from elsewhere
    keeps its category and place. The usual printer is back after the command."""
    import warnings

    from offloadopt.harness import train

    usual = warnings.showwarning

    def run(args):
        warnings.warn_explicit("from the library", UserWarning, "<frozen runpy>", 88)
        warnings.warn_explicit("from the script", UserWarning, sys.argv[0], 8)
        warnings.warn_explicit("from a dependency", DeprecationWarning, "/elsewhere/lib.py", 3)
        return 0

    monkeypatch.setattr(train, "run", run)
    assert main(TRAIN) == 0
    assert _lines(capsys.readouterr().err) == [
        "offloadopt: warning: from the library",
        "offloadopt: warning: from the script",
        "offloadopt: warning: DeprecationWarning: from a dependency (/elsewhere/lib.py:3)",
    ]
    assert warnings.showwarning is usual


def _until(condition, proc, deadline_s: float = 120.0) -> None:
    """Wait for ``condition()`` while ``proc`` runs."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _cli_process(tmp_path, argv: list[str], program: list[str] | None = None):
    """``python -m offloadopt ARGV`` (or ``python PROGRAM ARGV``) from this checkout
    (conftest.py), its stdout and stderr written to files (read with ``out()``, ``err()``).
    SIGINT's disposition is the default in the child whatever this process inherited: a shell
    starts background jobs with SIGINT ignored, a child inherits that, and Python then
    installs no Ctrl-C handler (the suite run in the background saw these tests time out)."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, *(program or ["-m", "offloadopt"]), *argv],
                                stdout=o, stderr=e, cwd=tmp_path,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    return proc, out.read_text, err.read_text


@pytest.mark.slow
def test_a_third_ctrl_c_ends_train_with_130_and_one_line(tmp_path):
    """A user's find: a triple Ctrl-C during ``offloadopt train`` printed a traceback (an atexit
    callback's, or one from ``main``'s own line) and ended with status -2. The interrupts
    after the first arrive here while the process ends (the interpreter's shutdown with torch
    loaded takes about a second): ignored, status 130 and the one line."""
    proc, out, err = _cli_process(tmp_path, ["train", "--preset", "tiny", "--steps", "100000",
                                             "--log-every", "1", "--eval-every", "100000",
                                             "--no-progress"])  # fmt: skip
    try:
        _until(lambda: "\nstep " in "\n" + out(), proc)
        proc.send_signal(signal.SIGINT)
        _until(lambda: "interrupted" in err(), proc, 60)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, err()) == (130, "offloadopt: interrupted\n")


@pytest.mark.slow
def test_a_third_ctrl_c_exits_at_once_when_the_clean_up_does_not_end(tmp_path):
    """The first two interrupts raise KeyboardInterrupt (the run stops, then its clean-up);
    the third exits at once, status 130 and the one line, even where the command catches
    every KeyboardInterrupt (a clean-up that hangs)."""
    program = tmp_path / "stuck.py"
    program.write_text(
        "import sys, time\n"
        "from offloadopt import cli\n"
        "from offloadopt.harness import train\n"
        "def stuck(args):\n"
        "    print('running', flush=True)\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(60)\n"
        "        except KeyboardInterrupt:\n"
        "            print('caught', flush=True)\n"
        "train.run = stuck\n"
        "sys.exit(cli.main())\n"
    )
    proc, out, err = _cli_process(tmp_path, ["train"], program=[str(program)])
    try:
        _until(lambda: "running" in out(), proc)
        for n in (1, 2):
            proc.send_signal(signal.SIGINT)
            _until(lambda n=n: out().count("caught") == n, proc, 30)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, err()) == (130, "offloadopt: interrupted\n")
