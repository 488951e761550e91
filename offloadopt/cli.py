"""Command line: ``offloadopt <command> [options]`` (also ``python -m offloadopt``).

Each command is one entry of ``COMMANDS``: a name, a one-line help, a function that adds its
options to a parser and a function that runs it on the parsed arguments and returns the exit
status. Adding a command is one import and one entry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from offloadopt.harness import audit_job, bench, train

# name -> (help, add_arguments(parser), run(args) -> exit status)
COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "train": (
        "train a GPT-2 preset on text, one log line per step",
        train.add_train_args,
        train.run,
    ),
    "bench": (
        "HybridAdamW at several offload fractions beside the anchors: table, JSON and plot",
        bench.add_bench_args,
        bench.run,
    ),
    "audit": (
        "every memcpy of a few training iterations: direction, pinned/pageable, bytes, GB/s",
        audit_job.add_audit_args,
        audit_job.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offloadopt", description="HybridAdamW: a CPU/GPU hybrid AdamW for PyTorch"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )  # fmt: skip
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status.

    Bad input (an invalid value, a missing file, an anchor that is not installed, a CUDA device
    on a machine without one) ends with one ``offloadopt: error: ...`` line and status 2.
    """
    import torch

    from offloadopt.harness.anchors import Unavailable

    parser = build_parser()
    args = parser.parse_args(argv)
    device = str(getattr(args, "device", "") or "")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}, but torch sees no CUDA device here (try --device cpu)")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, IsADirectoryError, Unavailable) as e:
        print(f"offloadopt: error: {e}", file=sys.stderr)
        return 2
