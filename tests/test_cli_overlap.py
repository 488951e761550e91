"""One name for HybridAdamW's overlap mode on every command: ``train --overlap``, ``bench
--overlap MODE...`` and ``audit --overlap MODE``. The former names (``bench --modes``, ``audit
--mode``) still parse, to the same arguments, for the commands and scripts that use them; ``--help``
shows ``--overlap`` alone, and a bad value is one usage line naming the flag as typed and the value.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from offloadopt.cli import build_parser, main

# (command, the flag's current spelling and its former one, values)
SPELLINGS = [
    ("bench", "--overlap", "--modes", ["step", "backward", "delayed"]),
    ("audit", "--overlap", "--mode", ["backward-clip"]),
]


def _parse(argv: list[str]) -> dict:
    return vars(build_parser().parse_args(argv))


@pytest.mark.parametrize("command, new, old, values", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_the_new_and_the_old_spelling_parse_to_the_same_arguments(command, new, old, values):
    dest = "modes" if command == "bench" else "mode"
    want = values if command == "bench" else values[0]
    given = _parse([command, new, *values, "--seed", "3"])
    assert given[dest] == want
    assert _parse([command, old, *values, "--seed", "3"]) == given
    # either spelling after the other: the last one given wins, as with one flag given twice
    assert _parse([command, old, "step", new, *values, "--seed", "3"]) == given
    assert _parse([command, new, "step", old, *values, "--seed", "3"]) == given
    # neither: the default, under the one name
    assert _parse([command])[dest] == (["step"] if command == "bench" else "step")


def test_train_takes_overlap_as_bench_and_audit_do():
    assert _parse(["train", "--overlap", "delayed"])["overlap"] == "delayed"


@pytest.mark.parametrize("command", ["bench", "audit"])
def test_help_shows_the_new_spelling_only(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([command, "--help"]) == 0
    text = out.getvalue()
    assert re.search(r"--overlap (MODE|\{step,)", text), text
    assert not re.search(r"--modes?\b", text), text


def _error_line(argv: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    assert status == 2 and out.getvalue() == "", (argv, status, err.getvalue())
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloadopt: error: "), lines
    return lines[0].removeprefix("offloadopt: error: ")


@pytest.mark.parametrize(
    "command, flag",
    [(c, f) for c, new, old, _ in SPELLINGS for f in (new, old)] + [("train", "--overlap")],
)
def test_a_bad_value_is_a_usage_error_naming_the_flag_and_the_value(command, flag):
    line = _error_line([command, flag, "sideways"])
    assert line.startswith(f"{flag}: invalid choice: 'sideways'"), line
    if command == "bench":  # each of several values is checked
        line = _error_line([command, flag, "step", "backward", "Delayed"])
        assert line.startswith(f"{flag}: invalid choice: 'Delayed'"), line
        assert _error_line([command, flag]) == f"{flag}: expected at least one argument"
    else:
        assert _error_line([command, flag]) == f"{flag}: expected one argument"


def test_a_config_or_combination_refused_after_parsing_names_the_new_flag(tmp_path):
    from offloadopt.harness import bench
    from offloadopt.harness.bench_options import BenchConfig
    from offloadopt.harness.checks import UsageError

    cfg = BenchConfig(preset="tiny", device="cpu", modes=["step", "sideways"], out=str(tmp_path))
    with pytest.raises(UsageError, match=r"^--overlap: 'sideways' is not one of step, "):
        bench.resolved(cfg)
    for flag in ("--overlap", "--mode"):
        line = _error_line(["audit", flag, "backward", "--optimizer", "adamw"])
        assert line == "--overlap backward: HybridAdamW's overlap modes need --optimizer hybrid"
