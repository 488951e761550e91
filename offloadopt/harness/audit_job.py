"""``offloadopt audit``: the main job's training iterations under the memcpy audit.

Builds the preset's model, warms up, then records N full iterations (batch transfer, forward,
backward, optimizer step; logging outside) with :func:`offloadopt.audit.audit` and prints the
memcpy table (in the spirit of Nsight Systems' memcpy summary) and one JSON line, per
iteration where it says so. Works for HybridAdamW and, when importable, for the anchors.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from offloadopt.harness import anchors
from offloadopt.harness.data import get_batch, load_text, mock_data
from offloadopt.harness.gpt import GPT, PRESETS

OPTIMIZERS = ("hybrid", "adamw", "megatron", "megatron-pinfix-fused", "torchao")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_optimizer(
    name: str, model: torch.nn.Module, lr: float, fraction: float, pin_memory: bool
) -> dict[str, Any]:
    """Build optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``model``'s params.

    Raises:
        ValueError: an unknown name.
        anchors.Unavailable: the anchor's package is not importable.
    """
    if name == "hybrid":
        return anchors.hybrid(fraction, pin_memory=pin_memory)(model, lr)
    if name == "adamw":
        return anchors.torch_adamw(model, lr)
    if name == "megatron":
        return anchors.megatron(fraction, fix_pinning=False, fused_cpu=False)(model, lr)
    if name == "megatron-pinfix-fused":
        return anchors.megatron(fraction, fix_pinning=True, fused_cpu=True)(model, lr)
    if name == "torchao":
        return anchors.torchao_offload(model, lr)
    raise ValueError(f"Invalid optimizer: {name!r} (choose from {', '.join(OPTIMIZERS)})")


def run_audit(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, audit ``args.steps`` iterations, print the table; return the JSON summary."""
    from offloadopt.audit import audit

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    with device:
        model = GPT(cfg).to(DTYPES[args.dtype])
    built = make_optimizer(
        args.optimizer, model, args.lr, args.offload_fraction, not args.no_pin_memory
    )
    opt = built["opt"]
    data = mock_data(cfg.vocab_size) if args.mock_data else load_text(args.data)
    gen = torch.Generator().manual_seed(args.seed)

    def iteration() -> torch.Tensor:
        x, y = get_batch(data, "train", args.batch_size, args.seq_len, gen, device)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        iteration()
    with audit(trace_path=args.trace) as a:
        for _ in range(args.steps):
            iteration()
    report = a.report
    print(f"memcpy audit: {args.optimizer} (fraction {args.offload_fraction}), preset {args.preset}, "
          f"{args.steps} iteration(s) after {args.warmup} warm-up, {device}")  # fmt: skip
    print(report.table())
    per = max(args.steps, 1)
    link = [r for r in report.rows if r.direction in ("HtoD", "DtoH")]
    pageable_h2d = [r for r in report.pageable_rows if r.direction == "HtoD"]
    summary = {
        "optimizer": args.optimizer, "offload_fraction": args.offload_fraction, "preset": args.preset,
        "iterations": args.steps, "copies_per_iteration": report.copy_count / per,
        "pageable_copies_per_iteration": report.pageable_count / per,
        "pageable_h2d_per_iteration": sum(r.count for r in pageable_h2d) / per,
        "pageable_h2d_avg_us": (sum(r.time_us for r in pageable_h2d) / max(1, sum(r.count for r in pageable_h2d))),
        "link_nbytes_per_iteration": sum(r.nbytes for r in link) / per,
        "trace": args.trace, "report": report.to_dict(),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "report"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return summary


def add_audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu"
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--optimizer", default="hybrid", choices=OPTIMIZERS)
    p.add_argument("--offload-fraction", type=float, default=1.0, help="for hybrid and megatron")
    p.add_argument(
        "--no-pin-memory",
        action="store_true",
        help="HybridAdamW(pin_memory=False): the pageable path",
    )
    p.add_argument("--steps", type=int, default=1, help="audited training iterations")
    p.add_argument(
        "--warmup", type=int, default=2, help="iterations before the audit (steady state)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="sequences per iteration")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mock-data", action="store_true", help="uniform random tokens")
    p.add_argument("--data", default=None, help="text file (default: CPython's pydoc topics)")
    p.add_argument("--trace", default=None, help="also write the Chrome trace to this file")
    p.add_argument("--json", default=None, help="write the full report as JSON to this file")


def run(args: argparse.Namespace) -> int:
    run_audit(args)
    return 0
