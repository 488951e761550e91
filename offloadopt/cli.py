"""Command line: ``offloadopt <command> [options]`` (also ``python -m offloadopt``).

Each command is one entry of ``COMMANDS``: a name, a one-line help, a function that adds its
options to a parser and the module whose ``run(args)`` runs it on the parsed arguments and
returns the exit status. The parsers come from ``offloadopt.harness.options``, which does not
import torch; a command's module (and torch) is imported only when the command runs, so
``--help`` answers at once. Adding a command is one entry.

``offloadopt --version`` prints the version. Every command takes ``--log-level`` (the level of
the ``offloadopt`` loggers: ``train``'s step lines are INFO) and ``--quiet`` (warnings and errors
only, and no progress bar); a command's result (``train``'s last JSON line, ``bench``'s table,
``audit``'s report) is printed either way.

Exit status: 0 done; 2 bad input (one ``offloadopt: error: ...`` line, printed before anything
is built or written); 1 a failure while running (one line; ``OFFLOADOPT_TRACEBACK=1`` re-raises
it, for the traceback), or a run that stopped itself at a NaN or infinite loss (one
``offloadopt: stopped: ...`` line naming the step and the checkpoint kept); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM: a scheduler's,
Docker's or torchrun's stop, handled as Ctrl-C is: the step in hand finishes first, and the
log is flushed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence

from offloadopt import __version__
from offloadopt.harness import bench_options, options
from offloadopt.harness.checks import RunStopped, UsageError

# name -> (help, add_arguments(parser), the module whose run(args) -> exit status runs it)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    "train": (
        "train a GPT-2 preset on text, one log line per step",
        options.add_train_args,
        "offloadopt.harness.train",
    ),
    "bench": (
        "HybridAdamW at several offload fractions beside the anchors: table, JSON and plot",
        bench_options.add_bench_args,
        "offloadopt.harness.bench",
    ),
    "audit": (
        "every memcpy of a few training iterations: direction, pinned/pageable, bytes, GB/s",
        bench_options.add_audit_args,
        "offloadopt.harness.audit_job",
    ),
}


EPILOG = (
    "exit status: 0 done, 2 bad input, 1 a failure while running or a stop at a NaN loss "
    "(OFFLOADOPT_TRACEBACK=1 shows its traceback), 130 interrupted (Ctrl-C; a third exits at "
    "once), 143 terminated (SIGTERM)"
)


# The start of a negative number (-5GB, -1e-3, -.5): never an option of these commands, so
# after an option that takes one value it is that value.
_DASH_VALUE = re.compile(r"-\.?[0-9]")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``offloadopt: error: --steps: 0 is not an integer >= 1``
    and status 2, without the usage block (``--help`` shows it).

    An option that takes one value takes one that starts like a negative number too, and its
    check names it (``--max-gpu-memory -5GB``: "Invalid size: '-5GB'"); argparse alone reads
    ``-5GB`` as an unknown option and says only "expected one argument"."""

    def __init__(self, *args, **kwargs) -> None:
        # before super().__init__, which adds --help through add_argument
        self._one_value: set[str] = set()
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.nargs is None:  # exactly one value
            self._one_value.update(action.option_strings)
        return action

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # a subcommand's parser is called here too, with the arguments after the command's name
        args = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":  # what follows is positional: left as it is
                joined += args[i:]
                break
            if joined and joined[-1] in self._one_value and _DASH_VALUE.match(arg):
                joined[-1] = f"{joined[-1]}={arg}"  # "--flag=-5GB" is argparse's own spelling
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse writes "argument --steps: ..."; the flag alone reads as the other errors do
        self.exit(2, f"offloadopt: error: {message.removeprefix('argument ')}\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" to an option's help unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--quiet``, which every command takes."""
    g = p.add_argument_group("output")
    g.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="the level of the offloadopt loggers (train's step lines are info)",
    )
    g.add_argument("--quiet", "-q", action="store_true",
                   help="warnings and errors only, and no progress bar (the result is printed)")  # fmt: skip


@contextlib.contextmanager
def _output_level(args: argparse.Namespace) -> Iterator[None]:
    """The ``offloadopt`` loggers at ``--log-level`` (``--quiet``: warning, and no progress bar)
    for the command; the level it had is back afterwards (``main`` may run in-process)."""
    logger = logging.getLogger("offloadopt")
    previous = logger.level
    level = "warning" if args.quiet and args.log_level in ("debug", "info") else args.log_level
    logger.setLevel(getattr(logging, level.upper()))
    if args.quiet and hasattr(args, "no_progress"):
        args.no_progress = True
    try:
        yield
    finally:
        logger.setLevel(previous)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="offloadopt",
        description="HybridAdamW: a CPU/GPU hybrid AdamW for PyTorch",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"offloadopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, module) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, epilog=EPILOG,
            formatter_class=_Help,
        )  # fmt: skip
        add_arguments(p)
        add_output_args(p)
        p.set_defaults(run_module=module)
    return parser


def _one_line(e: BaseException) -> str:
    """``e``'s first line, less the library's own "offloadopt: " (the line starts with it once:
    "offloadopt: error: KernelBuildError: offloadopt: ..." was a user's find)."""
    lines = str(e).strip().splitlines() or [""]
    return lines[0].removeprefix("offloadopt: ") + (" [...]" if len(lines) > 1 else "")


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command: raised where Ctrl-C's ``KeyboardInterrupt`` would be, so that
    the same clean-up runs (a fresh user's finding: SIGTERM killed ``train`` at once, status
    -15, with its buffered log lines lost)."""


def _terminate(signum: int, frame) -> None:
    raise Terminated()


class _Interrupts:
    """SIGINT's handler while a command runs (a user's find: a triple Ctrl-C printed a
    traceback, from an atexit callback or from ``main``'s own line, and the status was -2).
    The first two raise ``KeyboardInterrupt``, as Python's handler does (the first stops the
    run after the step in hand, the second its clean-up); the third exits at once, status 130
    with the one line. None raises once ``main`` has caught one (``ending``): the command is
    over, and its line is being printed."""

    def __init__(self) -> None:
        self.count, self.ending = 0, False
        self.holding, self.pending = False, False

    def __call__(self, signum: int, frame) -> None:
        self.count += 1
        if self.ending:
            return
        if self.count >= 3:
            with contextlib.suppress(Exception):  # the log lines printed so far are kept
                sys.stdout.flush()
            os.write(2, b"offloadopt: interrupted\n")  # raw: stderr may be mid-write here
            os._exit(130)
        if self.holding:  # raised when the held region ends (:meth:`held`)
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Ctrl-C inside the block raises when it ends (a third still exits at once): the
        options' checks import torch, and a KeyboardInterrupt inside that import was
        swallowed by torch's import of numpy (the run went on to the end, status 0), or left
        numpy half imported (an ImportError or RecursionError with a traceback). Not
        ``interrupts.signals_deferred``: that module imports torch, which ``--help`` and
        ``--version`` do not."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning during a command, as one ``offloadopt: warning: ...`` line. offloadopt's own
    warnings point past the library at their caller, which under the CLI is the command's
    harness, the ``offloadopt`` script or ``<frozen runpy>`` (a new user's find: ``offloadopt
    train`` printed ``/.../bin/offloadopt:8: UserWarning: ...`` and then ``sys.exit(main())``):
    those places are left out; any other warning keeps its category and place."""
    where = os.path.abspath(filename) if not filename.startswith("<") else filename
    ours = where.startswith(_PACKAGE + os.sep) or filename.startswith("<frozen") or (
        where == os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else False)  # fmt: skip
    text = f"{message}" if ours and category is UserWarning else (
        f"{category.__name__}: {message} ({filename}:{lineno})")  # fmt: skip
    print(f"offloadopt: warning: {text}", file=file if file is not None else sys.stderr)


def _unavailable() -> type[Exception]:
    """``anchors.Unavailable`` (an anchor's package is missing: bad input) once a command has
    imported it, else an exception nothing raises (importing anchors imports torch)."""
    anchors = sys.modules.get("offloadopt.harness.anchors")
    return anchors.Unavailable if anchors is not None else UsageError


def _check_environment() -> None:
    """The environment's settings, checked as the flags are: a bad one is a usage error
    (status 2) before the data is read (a user's trial: status 1, from the constructor)."""
    from offloadopt.harness.checks import UsageError
    from offloadopt.validation import check_environment

    try:
        check_environment()
    except ValueError as e:
        raise UsageError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status.

    Bad input (a value out of range, a device torch does not have here, a missing or too short
    data file, an output path that cannot be written, an anchor that is not installed) ends
    with one ``offloadopt: error: ...`` line on stderr and status 2, before a model is built
    or a file written; so does a bad ``OFFLOADOPT_DEVICE_STEP`` or ``OFFLOADOPT_UPDATE_THREAD``.
    A failure while running prints one line naming the exception and returns 1; with ``OFFLOADOPT_TRACEBACK=1`` in the environment it is re-raised instead.
    ``--help`` returns 0, Ctrl-C 130, SIGTERM 143 (raised as :class:`Terminated`, a
    ``KeyboardInterrupt``, so the same clean-up runs). A second Ctrl-C interrupts the clean-up,
    a third exits at once (130, the same line). With ``argv`` None (the console script,
    ``python -m offloadopt``: the process ends with the status returned) Ctrl-C is ignored
    from the return on, so the interpreter's shutdown (torch's finalizers) ends with that
    status and without a traceback; with ``argv`` given, SIGINT's handler is put back.
    """
    entry = argv is None  # this process's command line: it exits with the status returned
    previous = None  # SIGTERM's handler, when this replaced the default (main thread only)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        previous = signal.signal(signal.SIGTERM, _terminate)
    interrupts, previous_int = None, None  # SIGINT's, where Python's own handler was there
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        interrupts = _Interrupts()
        previous_int = signal.signal(signal.SIGINT, interrupts)
    try:
        # Ctrl-C while the options are checked (a new user's find: a 53-line traceback) goes
        # through the handlers below: SIGINT is ignored from main's return on there too (it
        # kept Python's handler, so a second Ctrl-C killed the shutdown: status -2)
        try:
            with interrupts.held() if interrupts is not None else contextlib.nullcontext():
                args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse's exit: --help (0) or a usage error (2)
            return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
        run = importlib.import_module(args.run_module).run  # torch is imported here
        _check_environment()
        with _output_level(args), warnings.catch_warnings():
            warnings.showwarning = _show_warning  # restored on the way out
            return run(args)
    except (UsageError, _unavailable()) as e:
        print(f"offloadopt: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunStopped as e:  # a NaN loss: one line, the step and the checkpoint kept
        print(f"offloadopt: stopped: {_one_line(e)}", file=sys.stderr)
        return 1
    except Terminated:
        _end(interrupts)
        print("offloadopt: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        _end(interrupts)
        print("offloadopt: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("OFFLOADOPT_TRACEBACK", "") not in ("", "0"):
            raise
        print(
            f"offloadopt: error: {type(e).__name__}: {_one_line(e)} "
            "(OFFLOADOPT_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if interrupts is not None:
            _end(interrupts)
            signal.signal(signal.SIGINT, signal.SIG_IGN if entry else previous_int)
        sys.stdout.flush()


def _end(interrupts: _Interrupts | None) -> None:
    """The command is over: an interrupt from here on raises nothing."""
    if interrupts is not None:
        interrupts.ending = True
