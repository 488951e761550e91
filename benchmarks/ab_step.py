"""A/B of the optimizer step on the GPU host: this tree against a baseline copy of the package,
with GPT-2's init, with LayerNorm weights at zero, and with tiny grads (the loss scaled by 1e-18:
grads near 1e-20, grad**2 subnormal in fp32; the subnormal cliff of the CPU kernel).

Usage (GPU host, repo root): python benchmarks/ab_step.py --baseline-dir .baseline --out $OUT
``--baseline-dir`` holds an older ``offloadopt`` renamed ``offloadopt_base`` (see gpu_run.sh);
without it only this tree runs. One process, configurations interleaved (A B B A), the same
initial weights and batches for each; medians of the timed steps after warm-up.

``--settings`` times this tree under several state representations in the same process (named
as in benchmarks/quality.py: fp32, bf16-moments, int8-moments, bf16-sr, bf16-sr+int8), each
against ``fp32`` (the first) in the summary.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from offloadopt.harness import models
from offloadopt.harness.data import get_batch, load_text

SETTINGS = {
    "fp32": {},
    "bf16-moments": dict(state_dtype="bf16"),
    "int8-moments": dict(state_dtype="int8"),
    "bf16-sr": dict(master_weights="bf16-sr"),
    "bf16-sr+int8": dict(master_weights="bf16-sr", state_dtype="int8"),
}


def zero_layernorm_(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
            m.weight.data.zero_()


def run_config(pkg, model, init, batches, fraction, warmup, steps, loss_scale=1.0, **kw):
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    loss_fn = models.loss_fn("gpt2-xl")
    t = time.perf_counter()
    opt = pkg.HybridAdamW(model.parameters(), lr=6e-4, weight_decay=0.1,
                          offload_fraction=fraction, **kw)  # fmt: skip
    if kw.get("wait") == "module":
        opt.watch(model)
    build_s = time.perf_counter() - t
    fb, total, cpu = [], [], []
    for i, (x, y) in enumerate(batches[: warmup + steps]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        (loss_fn(model, x, y) * loss_scale).backward()
        if (
            "overlap" not in kw
        ):  # step mode: time forward+backward apart (a sync that backward mode would pay)
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            fb.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
            cpu.append(opt.stats.get("cpu_update_ms", 0.0))
    if hasattr(opt, "synchronize"):  # wait="module": the last update is published here
        opt.synchronize()
    out = {
        "step_ms": statistics.median(total), "step_ms_min": min(total), "step_ms_max": max(total),
        "fwd_bwd_ms": statistics.median(fb), "cpu_update_ms": statistics.median(cpu),
        "build_s": build_s, "threads": opt.stats.get("cpu_threads", torch.get_num_threads()),
        "checksum": sum(float(p.detach().double().sum()) for p in model.parameters()),
    }  # fmt: skip
    if hasattr(opt, "close"):
        opt.close()
    del opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-xl")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--fraction", type=float, nargs="+", default=[1.0],
                    help="offload fractions, each timed for every implementation")  # fmt: skip
    ap.add_argument("--overlap", default="step", choices=["step", "backward", "delayed"])
    ap.add_argument("--inits", nargs="+", default=["gpt2-init", "zero-ln", "tiny-grads"],
                    choices=["gpt2-init", "zero-ln", "tiny-grads"])  # fmt: skip
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds, order alternating")
    ap.add_argument("--baseline-dir", default=None)
    ap.add_argument("--settings", nargs="+", default=["fp32"], choices=list(SETTINGS),
                    help="state representations of this tree, each timed (default: fp32)")  # fmt: skip
    ap.add_argument("--out", default="ab-out")
    args = ap.parse_args()
    new = importlib.import_module("offloadopt")
    impls = {("new" if s == "fp32" else s): (new, SETTINGS[s]) for s in args.settings}
    if args.baseline_dir:
        sys.path.insert(0, args.baseline_dir)
        impls["base"] = (importlib.import_module("offloadopt_base"), {})
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = models.build_model(args.preset, device, torch.bfloat16)
    inits = {"gpt2-init": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    zero_layernorm_(model)
    inits["zero-ln"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = load_text(None)
    gen = torch.Generator().manual_seed(0)
    batches = [get_batch(data, "train", args.batch_size, args.seq_len, gen, device)
               for _ in range(args.warmup + args.steps)]  # fmt: skip
    inits["tiny-grads"] = inits["gpt2-init"]
    scales = {"gpt2-init": 1.0, "zero-ln": 1.0, "tiny-grads": 1e-18}
    order = []
    # backward mode as the overlap bench's best case: nothing edits grads after backward
    kw = {} if args.overlap == "step" else dict(overlap=args.overlap)
    if args.overlap == "backward":
        kw.update(wait="module", grads_final=True)
    for r in range(args.rounds):
        names = list(impls) if r % 2 == 0 else list(reversed(list(impls)))
        order += [(i, n, f) for f in args.fraction for n in args.inits for i in names]
    results: dict[str, list[dict]] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for impl, init, fraction in order:
        pkg, setting = impls[impl]
        r = run_config(
            pkg, model, inits[init], batches, fraction, args.warmup, args.steps,
            loss_scale=scales[init], **kw, **setting,
        )  # fmt: skip
        results.setdefault(f"{impl}/{init}/f{fraction:g}", []).append(r)
        print(f"{impl:5} {init:10} f{fraction:<4g} step {r['step_ms']:7.1f} ms (min {r['step_ms_min']:.1f}, max "
              f"{r['step_ms_max']:.1f})  fwd+bwd {r['fwd_bwd_ms']:6.1f}  cpu update "
              f"{r['cpu_update_ms']:6.1f}  threads {r['threads']}", flush=True)  # fmt: skip
        (out / "ab_step.json").write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1)
        )
    print(f"\n{args.preset} bf16 batch {args.batch_size}x{args.seq_len} {args.overlap} mode, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}; median of the runs' medians")  # fmt: skip
    summary = {k: statistics.median(r["step_ms"] for r in v) for k, v in results.items()}
    for k, v in summary.items():
        print(f"  {k:18} {v:7.1f} ms")
    for f in args.fraction:
        for init in args.inits:
            new, base = summary.get(f"new/{init}/f{f:g}"), summary.get(f"base/{init}/f{f:g}")
            if new is not None and base is not None:
                print(f"  new / base ({init}, f{f:g}): {new / base:.3f}")
            for s in args.settings[1:]:
                this, ref = summary.get(f"{s}/{init}/f{f:g}"), summary.get(f"new/{init}/f{f:g}")
                if this is not None and ref is not None:
                    print(f"  {s} / fp32 ({init}, f{f:g}): {this / ref:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
