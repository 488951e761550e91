"""Why did the width-4096 presets' loss rise at lr 2e-6 (issue 47)? gpt-9b's went 6.06 -> 13.5
by step 11 with 10 warm-up steps (delayed, bf16-sr + int8, fraction 1); gpt-32b's 5.36 -> 14.6
at step 3 (backward, bf16-sr + int8, auto). At that lr AdamW moves each weight by about 2e-6 a
step (0.01% of the init's 0.02): correct updates cannot move the loss that far, so either the
model is that sensitive or some path moves weights far more than lr.

One process, one model shape (width 4096 like the presets, ``--layers`` blocks, byte vocabulary,
bf16 params), the same init and the same batches of real text for every configuration:

- ``fp32``: fp32 weights, offload fraction 0 (torch's fused AdamW: the dynamics without
  bf16); ``ref``: bf16 weights, fraction 0, fp32 state and fp32 masters;
- the configurations of ``--configs`` (name=options, see CONFIGS): fraction 1 with fp32 state,
  with bf16-sr + int8 in step and delayed mode, fraction 0 with bf16-sr + int8 (the device pass).

Per step and configuration: the training loss, and the largest and the mean absolute change of
the weights from their init (the bf16 params), beside ``lr`` x step (the most Adam's
sign-like first steps can move a weight). Writes ``--out``/width_loss.json; prints a table.

Usage (GPU host, repo root): PYTHONPATH=$PWD python benchmarks/probes/width_loss.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from offloadopt import HybridAdamW
from offloadopt.harness.data import get_batch, load_text
from offloadopt.harness.gpt import GPT
from offloadopt.harness.presets import GPTConfig
from offloadopt.harness.train import lr_at

CONFIGS = {
    "fp32": dict(offload_fraction=0.0, dtype=torch.float32),  # fp32 weights: AdamW's own steps
    "ref": dict(offload_fraction=0.0),
    "f1": dict(offload_fraction=1.0),
    "f1-sr8": dict(offload_fraction=1.0, state_dtype="int8", master_weights="bf16-sr"),
    "f1-sr8-delayed": dict(
        offload_fraction=1.0, state_dtype="int8", master_weights="bf16-sr", overlap="delayed"
    ),  # fmt: skip
    "f0-sr8": dict(offload_fraction=0.0, state_dtype="int8", master_weights="bf16-sr"),
    "f1-int8": dict(offload_fraction=1.0, state_dtype="int8"),
}


def model_of(layers: int, width: int, device: str, dtype=torch.bfloat16) -> GPT:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GPT(GPTConfig(n_layer=layers, n_head=max(1, width // 128), n_embd=width,
                                 vocab_size=256, block_size=1024))  # fmt: skip
    finally:
        torch.set_default_dtype(default)


def run(name: str, args, data, init: list[torch.Tensor]) -> list[dict]:
    opts = dict(CONFIGS[name])
    dtype = opts.pop("dtype", torch.bfloat16)
    model = model_of(args.layers, args.width, args.device, dtype)
    model.checkpointing = True
    if opts.get("master_weights") is None and dtype == torch.bfloat16:
        opts["master_weights"] = True
    opt = HybridAdamW(model.named_parameters(), lr=args.lr, betas=(0.9, 0.95),
                      weight_decay=0.1, **opts)  # fmt: skip
    if opts.get("overlap") == "delayed":
        opt.watch(model)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        t = time.perf_counter()
        total = 0.0
        for _ in range(args.accum):
            x, y = get_batch(data, "train", args.batch, args.seq, gen, args.device)
            _, loss = model(x, y)
            (loss / args.accum).backward()
            total += float(loss) / args.accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.synchronize()
        if args.device != "cpu":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        with torch.no_grad():
            most = mean = 0.0
            for p, w in zip(params, init, strict=True):
                d = (p.float() - w.float()).abs()
                most, mean = max(most, float(d.max())), mean + float(d.sum())
            mean /= sum(p.numel() for p in params)
        rows.append(dict(step=step, loss=total, max_change=most, mean_change=mean, ms=ms))
        print(f"{name:>15} step {step:3d} loss {total:8.4f} max|dw| {most:.3e} "
              f"mean|dw| {mean:.3e} {ms:8.1f} ms", flush=True)  # fmt: skip
        if not math.isfinite(total):
            break
    opt.close()
    del model, opt
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="blocks (default 8)")
    ap.add_argument("--width", type=int, default=4096, help="model width (default 4096)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens a sequence (default 1024)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (as the runs)")
    ap.add_argument("--lr", type=float, default=2e-6, help="peak lr (the presets' 2e-6)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    data = load_text()
    init = [p.detach().clone() for p in model_of(args.layers, args.width, args.device).parameters()]
    print(f"width {args.width}, {args.layers} blocks, {sum(p.numel() for p in init) / 1e9:.2f}e9 "
          f"params; lr {args.lr:g}, warm-up {args.warmup}; batch {args.batch} x 1024 x "
          f"{args.accum}", flush=True)  # fmt: skip
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for name in args.configs:
        result["runs"][name] = run(name, args, data, init)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "width_loss.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'config':>15} " + " ".join(f"{s:>7}" for s in range(1, args.steps + 1)))
    for name, rows in result["runs"].items():
        print(f"{name:>15} " + " ".join(f"{r['loss']:7.3f}" for r in rows))


if __name__ == "__main__":
    main()
