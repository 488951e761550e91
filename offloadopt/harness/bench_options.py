"""The ``bench`` and ``audit`` commands' configs and options, without importing torch (as
``options.py``, which holds ``train``'s and the names the commands share): ``offloadopt --help``
builds every parser from here and there, so it starts at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from offloadopt.harness import checks
from offloadopt.harness.options import DTYPE_NAMES, MASTERS, STATE_DTYPES
from offloadopt.harness.presets import ANCHOR_NAMES, MODEL_PRESETS, MODES, PRESETS

__all__ = ["BenchConfig", "BENCH_FIELD_CHECKS", "add_bench_args", "AUDIT_OPTIMIZERS"]
__all__ += ["add_audit_args"]


def _old_spelling(p: argparse.ArgumentParser, flag: str, dest: str, **kwargs) -> None:
    """``flag``, a former name of an option of ``p`` kept working: it sets the same ``dest``
    (checked as the option is), is left out of ``--help``, and its errors name it as typed.
    A separate option rather than a second option string of the same one, which ``--help``
    would show and argparse's errors would name ``--new/--old``."""
    p.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


# --- bench --------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    preset: str = "gpt2-xl"  # model preset (offloadopt.harness.models.MODEL_PRESETS)
    device: str = "cuda"  # cuda, or cpu for a smoke test of the harness
    dtype: str = "bf16"  # model weights: bf16 or fp32
    batch_size: int = 4  # sequences per step
    seq_len: int | None = None  # tokens per sequence; None: the preset's longest, at most 1024
    warmup: int = 3  # untimed steps per configuration
    steps: int = 10  # timed steps per configuration (medians over these)
    slow_steps: int = 3  # timed steps for anchors known to take seconds per step
    lr: float = 6e-4  # AdamW learning rate
    fractions: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.25, 0.5, 1.0])
    modes: list[str] = field(default_factory=lambda: ["step"])  # presets.MODES: each a sweep
    anchors: list[str] = field(default_factory=lambda: list(ANCHOR_NAMES))  # anchors.ANCHORS' keys
    kernel: bool = True  # also time torch's fused AdamW kernel alone on the host
    mock_data: bool = False  # uniform random tokens instead of the real text
    data: str | None = None  # text file (default: CPython's pydoc topics)
    seed: int = 0
    out: str = "bench-out"  # folder for bench.json and bench.png
    audit: bool = True  # audit one training iteration per configuration (pageable copies)
    progress: bool = True
    fsdp: bool = False  # under torchrun: every configuration under FSDP2 across the job's ranks
    state_dtype: str = "fp32"  # HybridAdamW configurations: the moments' representation
    master_weights: str = "fp32"  # HybridAdamW configurations: "fp32" masters or "bf16-sr"


# The check of each BenchConfig field that has one: its --flag's argparse type, and
# resolved()'s check of a config built in Python.
BENCH_FIELD_CHECKS = {
    "device": checks.device, "batch_size": checks.positive_int, "seq_len": checks.positive_int,
    "warmup": checks.nonneg_int, "steps": checks.positive_int, "slow_steps": checks.positive_int,
    "lr": checks.nonneg_float, "data": checks.input_file, "seed": checks.seed, "out": checks.out_dir,
}  # fmt: skip


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``p``; values are checked as they are parsed."""
    d, t = BenchConfig(), BENCH_FIELD_CHECKS
    a = p.add_argument
    # fmt: off
    a("--preset", default=None, choices=MODEL_PRESETS,
      help="model; hf-* build a transformers model from its config (default: gpt2-xl with a "
           "GPU, else tiny)")
    a("--device", type=t["device"], default=None,
      help="cuda, cuda:N or cpu (default: cuda if available)")
    a("--dtype", default=d.dtype, choices=sorted(DTYPE_NAMES),
      help="the model's params and activations, on every device (default: %(default)s)")
    a("--batch-size", type=t["batch_size"], default=d.batch_size, help="sequences per step")
    a("--seq-len", type=t["seq_len"], default=None,
      help="tokens per sequence (default: the preset's longest, at most 1024)")
    a("--warmup", type=t["warmup"], default=d.warmup, help="untimed steps per configuration")
    a("--steps", type=t["steps"], default=d.steps, help="timed steps per configuration")
    a("--slow-steps", type=t["slow_steps"], default=d.slow_steps, help="timed steps, slow anchors")
    a("--lr", type=t["lr"], default=d.lr, help="AdamW learning rate, >= 0")
    a("--fractions", type=checks.fraction, nargs="+", default=d.fractions,
      help="HybridAdamW offload fractions, each in [0, 1]")
    a("--overlap", dest="modes", nargs="+", default=d.modes, choices=list(MODES),
      metavar="MODE",
      help=f"overlap modes, each a sweep of --fractions beside step mode's (the baseline): any "
           f"of {list(MODES)} (backward: grads_final, wait='module'; backward-torch-clip: torch's clip_grad_norm_ 1.0 "
           "before step(), wait='module'; backward-clip: "
           "max_grad_norm=1.0)")
    _old_spelling(p, "--modes", "modes", nargs="+", choices=list(MODES))
    a("--anchors", nargs="*", default=d.anchors, choices=list(ANCHOR_NAMES), metavar="ANCHOR",
      help=f"any of {sorted(ANCHOR_NAMES)}; none: --anchors")
    a("--state-dtype", default=d.state_dtype, choices=list(STATE_DTYPES),
      help="every HybridAdamW configuration's exp_avg/exp_avg_sq: fp32 (torch's), bf16 or int8")
    a("--master-weights", default=d.master_weights, choices=list(MASTERS),
      help="every HybridAdamW configuration's masters: fp32, or bf16-sr (none: the bf16 "
           "weights rounded stochastically)")
    a("--no-kernel", action="store_true", help="skip timing the fused kernel alone")
    a("--no-audit", action="store_true", help="skip the memcpy audit of each configuration")
    a("--mock-data", action="store_true", help="uniform random tokens")
    a("--data", type=t["data"], default=None, help="text file (default: CPython's pydoc topics)")
    a("--seed", type=t["seed"], default=d.seed, help="0 .. 2**63 - 1")
    a("--out", type=t["out"], default=d.out, help="folder for bench.json and bench.png")
    a("--no-progress", action="store_true", help="no tqdm progress bar on stderr")
    a("--fsdp", action="store_true",
      help="under torchrun: every configuration under FSDP2 across the job's ranks; rank 0 "
           "writes each rank's figures and the job's totals (the kernel timing is skipped)")
    # fmt: on


# --- audit --------------------------------------------------------------------------------------

AUDIT_OPTIMIZERS = ("hybrid", "adamw", "megatron", "megatron-pinfix-fused", "torchao")


def add_audit_args(p: argparse.ArgumentParser) -> None:
    """Add the ``audit`` options to ``p``; values are checked as they are parsed."""
    a = p.add_argument
    # fmt: off
    a("--device", type=checks.device, default=None,
      help="cuda, cuda:N or cpu (default: cuda if available)")
    a("--preset", default="tiny", choices=sorted(PRESETS))
    a("--dtype", default="bf16", choices=sorted(DTYPE_NAMES),
      help="the model's params and activations (default: %(default)s)")
    a("--optimizer", default="hybrid", choices=AUDIT_OPTIMIZERS)
    a("--offload-fraction", type=checks.fraction, default=1.0, help="for hybrid and megatron")
    a("--overlap", dest="mode", default="step", choices=tuple(MODES),
      help="HybridAdamW's overlap mode (backward: grads_final, wait='module'; backward-clip: "
           "max_grad_norm=1.0; delayed: the delayed update)")
    _old_spelling(p, "--mode", "mode", choices=tuple(MODES))
    a("--no-pin-memory", action="store_true",
      help="HybridAdamW(pin_memory=False): the pageable path")
    a("--state-dtype", default="fp32", choices=list(STATE_DTYPES),
      help="HybridAdamW's exp_avg/exp_avg_sq: fp32 (torch's), bf16 or int8")
    a("--master-weights", default="fp32", choices=list(MASTERS),
      help="HybridAdamW's masters: fp32, or bf16-sr (the bf16 weights rounded stochastically)")
    a("--steps", type=checks.positive_int, default=1, help="audited training iterations")
    a("--warmup", type=checks.nonneg_int, default=2,
      help="iterations before the audit (steady state)")
    a("--batch-size", type=checks.positive_int, default=4, help="sequences per iteration")
    a("--seq-len", type=checks.positive_int, default=128,
      help="tokens per sequence, at most the preset's block_size")
    a("--lr", type=checks.nonneg_float, default=6e-4)
    a("--seed", type=checks.seed, default=0, help="0 .. 2**63 - 1")
    a("--mock-data", action="store_true", help="uniform random tokens")
    a("--data", type=checks.input_file, default=None,
      help="text file (default: CPython's pydoc topics)")
    a("--trace", type=checks.chrome_trace_file, default=None,
      help="also write the Chrome trace to this file (.json or .json.gz)")
    a("--json", type=checks.json_output_file, default=None,
      help="write the full report as JSON to this file")
    a("--no-progress", action="store_true",
      help="no tqdm progress bar on stderr (as train's and bench's; a bar shows on a terminal "
           "only)")
    # fmt: on
