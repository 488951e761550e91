"""Ctrl-C at the edges of a checkpoint save and of the options' checks (a new user's finds):
a second Ctrl-C as torch's zip writer began its ``__exit__`` ended the process in
std::terminate (status 134); one Ctrl-C just after a streamed save's rename left the previous
checkpoint beside the new one under its hidden ``.old`` name; Ctrl-C while ``train`` checked its
options (torch imported there) was swallowed or left SIGINT's Python handler for the shutdown
(status -2); Ctrl-C while ``python -m offloadopt`` or the console script imported the command
line itself, before its handlers, was a KeyboardInterrupt traceback (status -2)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ABORT = textwrap.dedent(
    """
    import os, signal, torch, torch.serialization as ser
    from offloadopt.state import integrity
    state = {"n": 0, "first": False}
    write = integrity._HashingWriter.write
    def hooked(self, b):
        state["n"] += 1
        if state["n"] == 3:
            state["first"] = True
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in a write
        return write(self, b)
    integrity._HashingWriter.write = hooked
    exit_ = ser._open_zipfile_writer_buffer.__exit__
    def hooked_exit(self, *a):
        if state["first"]:
            os.kill(os.getpid(), signal.SIGINT)  # the second, as __exit__ begins
        return exit_(self, *a)
    ser._open_zipfile_writer_buffer.__exit__ = hooked_exit
    try:
        integrity.fsync_save({"w": torch.randn(300, 300)}, PATH)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print("done", flush=True)
    """
)


def test_a_second_ctrl_c_as_torch_save_ends_is_no_abort(tmp_path):
    code = ABORT.replace("PATH", repr(str(tmp_path / "ck.pt")))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["interrupted", "done"]


def test_a_ctrl_c_after_the_rename_leaves_no_old_checkpoint(tmp_path, monkeypatch):
    import torch

    from offloadopt import HybridAdamW
    from offloadopt.state import integrity, streamed

    model = torch.nn.Linear(64, 64)
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, min_offload_numel=0)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    path = str(tmp_path / "ckpt")
    opt.save_streamed(path, model=model)
    calls = []
    fsync_dir = integrity.fsync_dir

    def hooked(p):
        calls.append(p)
        if len(calls) == 2:  # the flush of the renames: the new checkpoint is in place
            os.kill(os.getpid(), signal.SIGINT)
        return fsync_dir(p)

    monkeypatch.setattr(streamed.integrity, "fsync_dir", hooked)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.save_streamed(path, model=model)
    finally:
        signal.signal(signal.SIGINT, previous)
        opt.close()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


CHECKS = textwrap.dedent(
    """
    import argparse, os, signal, sys, time
    from offloadopt import cli
    parse = argparse.ArgumentParser.parse_args
    def hooked(self, *a, **k):  # Ctrl-C while the options are checked (torch imported there)
        os.kill(os.getpid(), signal.SIGINT)
        return parse(self, *a, **k)
    argparse.ArgumentParser.parse_args = hooked
    sys.argv = ["offloadopt", "train", "--preset", "tiny", "--steps", "30", "--no-progress"]
    status = cli.main()
    os.kill(os.getpid(), signal.SIGINT)  # another during the shutdown: ignored from main's return
    time.sleep(0.2)
    sys.exit(status)
    """
)


def test_ctrl_c_while_train_checks_its_options_ends_130():
    """The Ctrl-C goes through main's handlers: 130 and one line, and SIGINT ignored from
    main's return on (Python's handler was left in place there: a traceback, status 1, or -2
    in the shutdown)."""
    r = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip().splitlines()[-1] == "offloadopt: interrupted", r.stderr[-2000:]


# Ctrl-C as the command line's own import reaches MODULE (a finder that Python asks first),
# then the program as ``python -m offloadopt`` or the console script runs it
AT_IMPORT = textwrap.dedent(
    """
    import os, signal, sys
    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == MODULE:
                os.kill(os.getpid(), signal.SIGINT)
            return None
    sys.meta_path.insert(0, CtrlC())
    sys.argv = ["offloadopt", "train", "--preset", "tiny", "--steps", "2", "--save", "ck"]
    """
)
PYTHON_M = 'import runpy; runpy.run_module("offloadopt", run_name="__main__", alter_sys=True)'


def _console_script() -> str:
    """What the ``offloadopt`` script pip writes runs: pyproject.toml's entry point."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    module, name = re.search(r'^offloadopt = "([\w.]+):(\w+)"$', text, re.M).groups()
    return f"import importlib; sys.exit(importlib.import_module({module!r}).{name}())"


@pytest.mark.parametrize("module", ["offloadopt.cli", "offloadopt.harness.options",
                                    "offloadopt.harness.checks"])  # fmt: skip
@pytest.mark.parametrize("program", ["python -m offloadopt", "console script"])
def test_ctrl_c_while_the_command_line_is_imported_ends_130(tmp_path, module, program):
    """The first ~0.05 s of ``offloadopt train``, before ``cli.main`` installs its handlers:
    one line and 130, as a later Ctrl-C, and nothing written (it was a traceback, status -2)."""
    run = PYTHON_M if program == "python -m offloadopt" else _console_script()
    code = AT_IMPORT.replace("MODULE", repr(module)) + run
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "offloadopt: interrupted\n")
    assert os.listdir(tmp_path) == []
