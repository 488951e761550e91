"""``offloadopt audit``: the main job's training iterations under the memcpy audit.

Builds the preset's model, warms up, then records N full iterations (batch transfer, forward,
backward, optimizer step; logging outside) with :func:`offloadopt.audit.audit` and prints the
memcpy table (in the spirit of Nsight Systems' memcpy summary) and one JSON line, per
iteration where it says so. Works for HybridAdamW (in any overlap mode, ``--overlap``) and, when
importable, for the anchors. Each ``loss.backward()`` runs inside an
:data:`offloadopt.audit.BACKWARD_RANGE` annotation, so the table's "w/ bwd %" is the share of
each copy kind's time that ran beside backward's kernels (backward mode's D2H).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from tqdm import tqdm

from offloadopt.harness import anchors, checks, provenance
from offloadopt.harness.bench_options import (  # noqa: E402, F401 - their old home is here
    AUDIT_OPTIMIZERS as OPTIMIZERS,
)
from offloadopt.harness.checks import UsageError
from offloadopt.harness.data import get_batch, mock_data
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.options import (
    resolve_device,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_optimizer(
    name: str, model: torch.nn.Module, lr: float, fraction: float, pin_memory: bool,
    mode: str = "step", representation: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Build optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``model``'s params; ``mode``
    (a key of ``anchors.MODES``) applies to ``"hybrid"``.

    Raises:
        ValueError: an unknown name.
        anchors.Unavailable: the anchor's package is not importable.
    """
    if name == "hybrid":
        return anchors.hybrid(fraction, mode, pin_memory=pin_memory,
                              **(representation or {}))(model, lr)  # fmt: skip
    if name == "adamw":
        return anchors.torch_adamw(model, lr)
    if name == "megatron":
        return anchors.megatron(fraction, fix_pinning=False, fused_cpu=False)(model, lr)
    if name == "megatron-pinfix-fused":
        return anchors.megatron(fraction, fix_pinning=True, fused_cpu=True)(model, lr)
    if name == "torchao":
        return anchors.torchao_offload(model, lr)
    raise ValueError(f"Invalid optimizer: {name!r} (choose from {', '.join(OPTIMIZERS)})")


def worker_line(stats: dict[str, Any]) -> str:
    """The CPU worker's threads and cores from ``opt.stats`` (empty without a worker), e.g.
    ``"CPU worker: 15 threads on CPUs 1-15; CPU 0 left to the training thread"``."""
    threads = stats.get("cpu_threads")
    if not threads:
        return ""

    def cpus(text: str) -> str:
        return f"CPU{'s' if ',' in text or '-' in text else ''} {text}"

    pinned = stats.get("worker_cpus") not in (None, "", "any")
    where = cpus(stats["worker_cpus"]) if pinned else "any CPU (unpinned)"
    left = stats.get("training_cpus")
    left = f"; {cpus(left)} left to the training thread" if left else ""
    return f"CPU worker: {threads} thread{'s' if threads != 1 else ''} on {where}{left}"


# the optimizers that take --offload-fraction (the others report none: a new user's find, adamw's
# JSON said "offload_fraction": 1.0)
FRACTIONED = ("hybrid", "megatron", "megatron-pinfix-fused")


def check_args(args: argparse.Namespace) -> None:
    """What the option types cannot check alone; raises ``UsageError`` naming the flag."""
    block_size = PRESETS[args.preset].block_size
    if args.seq_len > block_size:
        raise UsageError(
            f"--seq-len: {args.seq_len} is more than the {args.preset} preset's block_size "
            f"{block_size}"
        )
    if args.mode != "step" and args.optimizer != "hybrid":
        raise UsageError(
            f"--overlap {args.mode}: HybridAdamW's overlap modes need --optimizer hybrid"
        )
    for flag, value in (
        ("--state-dtype", args.state_dtype),
        ("--master-weights", args.master_weights),
    ):
        if value != "fp32" and args.optimizer != "hybrid":
            raise UsageError(f"{flag} {value}: HybridAdamW's option; --optimizer "
                             f"{args.optimizer} would ignore it")  # fmt: skip
    if args.no_pin_memory and args.optimizer != "hybrid":
        raise UsageError(f"--no-pin-memory: HybridAdamW's option; --optimizer {args.optimizer} "
                         "would ignore it")  # fmt: skip
    if args.offload_fraction != 1.0 and args.optimizer not in FRACTIONED:
        raise UsageError(f"--offload-fraction {args.offload_fraction:g}: --optimizer "
                         f"{args.optimizer} has no fraction (it would be ignored)")  # fmt: skip
    if args.mock_data and args.data is not None:
        raise UsageError(f"--mock-data with --data {args.data}: random tokens replace the text "
                         "(the file would be ignored); give one")  # fmt: skip
    if args.trace is not None and args.json is not None:
        if os.path.abspath(args.trace) == os.path.abspath(args.json):
            raise UsageError(f"--trace and --json: both {args.json!r}; give two files")


def run_audit(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, audit ``args.steps`` iterations, print the table; return the JSON summary.

    Checks its input first (``UsageError``), the data file included, before a model is built;
    ``--trace`` and ``--json`` are each written whole at the end.
    """
    from offloadopt.audit import BACKWARD_RANGE, audit

    check_args(args)
    cfg = PRESETS[args.preset]
    data = (
        mock_data(cfg.vocab_size) if args.mock_data else checks.text_data(args.data, args.seq_len)
    )
    device = torch.device(resolve_device(args.device))  # None: cuda if available
    torch.manual_seed(args.seed)
    with device:
        model = GPT(cfg).to(DTYPES[args.dtype])
    built = make_optimizer(
        args.optimizer,
        model,
        args.lr,
        args.offload_fraction,
        not args.no_pin_memory,
        args.mode,
        anchors.representation(args.state_dtype, args.master_weights),
    )
    opt = built["opt"]
    gen = torch.Generator().manual_seed(args.seed)

    def iteration() -> torch.Tensor:
        x, y = get_batch(data, "train", args.batch_size, args.seq_len, gen, device)
        _, loss = model(x, y)
        with torch.profiler.record_function(BACKWARD_RANGE):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = getattr(opt, "synchronize", lambda: None)  # wait="module", delayed: copies in flight
    # the warm-up and audited iterations; None: tqdm's own rule, a bar on a terminal only
    bar = tqdm(total=args.warmup + args.steps, desc="audit", file=sys.stderr,
               disable=True if getattr(args, "no_progress", False) else None)  # fmt: skip
    with bar:
        for _ in range(args.warmup):
            iteration()
            bar.update()
        sync()
        counted = dict(getattr(opt, "speculation", None) or {})
        with audit(trace_path=args.trace) as a:
            for _ in range(args.steps):
                iteration()
                bar.update()
            sync()
    report = a.report
    spec = getattr(opt, "speculation", None)  # speculate=True: the audited iterations' counts
    if spec is not None:
        kept = ("backup_nbytes", "device_extra_peak_nbytes")  # held or peaked: not counted
        spec = {k: v - counted.get(k, 0) if k not in kept else v for k, v in spec.items()}
    mode = f", {args.mode} mode" if args.optimizer == "hybrid" else ""
    fraction = args.offload_fraction if args.optimizer in FRACTIONED else None
    shown = f" (fraction {fraction}{mode})" if fraction is not None else ""
    print(f"memcpy audit: {args.optimizer}{shown}, preset "
          f"{args.preset}, {args.steps} iteration(s) after {args.warmup} warm-up, {device}")  # fmt: skip
    if device.type == "cpu":  # no link: an empty table and "0 copies" would read as a finding
        print(f"memcpy audit {provenance.CPU_AUDIT_NOTE}")
    else:
        print(report.table())
    worker = worker_line(getattr(opt, "stats", None) or {})
    if worker:
        print(worker)
    if spec is not None:
        print(f"speculative updates: {spec['buckets']} bucket updates in {spec['steps']} "
              f"iteration(s); redone: {spec['redone_buckets']} bucket updates, in "
              f"{spec['redone_clip']} iteration(s) for the clip and {spec['redone_inf']} for an "
              f"inf (their copies are in the table: a redone bucket crosses the link twice); "
              f"backup {spec['backup_nbytes'] / 1e9:.3f} GB of host memory")  # fmt: skip
    per = max(args.steps, 1)
    link = [r for r in report.rows if r.direction in ("HtoD", "DtoH")]
    pageable_h2d = [r for r in report.pageable_rows if r.direction == "HtoD"]
    summary = {
        "optimizer": args.optimizer, "offload_fraction": fraction, "preset": args.preset,
        "iterations": args.steps, "copies_per_iteration": report.copy_count / per,
        "pageable_copies_per_iteration": report.pageable_count / per,
        "pageable_h2d_per_iteration": sum(r.count for r in pageable_h2d) / per,
        "pageable_h2d_avg_us": (sum(r.time_us for r in pageable_h2d) / max(1, sum(r.count for r in pageable_h2d))),
        "link_nbytes_per_iteration": sum(r.nbytes for r in link) / per,
        "mode": args.mode if args.optimizer == "hybrid" else None,
        "cpu_worker": worker or None,
        "speculation": spec,
        # the share of the link's copy time (D2H, H2D) with a backward kernel running beside it
        **{f"{d.lower()}_beside_backward_pct": (
            100.0 * sum(r.overlap_backward_us for r in link if r.direction == d)
            / max(sum(r.time_us for r in link if r.direction == d), 1e-9)) for d in ("DtoH", "HtoD")},
        "trace": args.trace, "device": device.type, "report": report.to_dict(),
    }  # fmt: skip
    if device.type == "cpu":
        summary["measures"] = provenance.CPU_AUDIT_NOTE
    print(json.dumps({k: v for k, v in summary.items() if k != "report"}))
    if args.json is not None:
        checks.write_atomic(args.json, json.dumps(summary, indent=1, default=str))
    return summary


def run(args: argparse.Namespace) -> int:
    run_audit(args)
    return 0
