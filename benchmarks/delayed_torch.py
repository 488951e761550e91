"""Is the delayed update's convergence gap (issue 9) the algorithm's or ours? Plain
``torch.optim.AdamW(fused=True)`` whose forward reads the weights one step old
(w_{t+1} = AdamW(w_t, grad at w_{t-1}), the delayed parameter update's semantics, README "The
delayed parameter update"), against the same optimizer synchronous, on the main job's tiny
preset, data, schedule and clipping. No offloadopt code runs in the update.

    python benchmarks/delayed_torch.py [--seeds 0 1] [--lr 3e-3]

Prints the final held-out loss (nats) per seed for both.
"""

from __future__ import annotations

import argparse

import torch

from offloadopt.harness import checks
from offloadopt.harness.data import get_batch
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.train import TrainConfig, evaluate, lr_at


def run(seed: int, delayed: bool, lr: float | None, steps: int) -> float:
    cfg = TrainConfig(steps=steps, seed=seed, lr=lr, eval_every=steps, progress=False).resolved()
    torch.manual_seed(cfg.seed)
    model = GPT(PRESETS[cfg.preset])
    data = checks.text_data(cfg.data, cfg.seq_len)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=True)  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    stale = [p.detach().clone() for p in params]  # what the next forward reads
    for step in range(1, cfg.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, "cpu")
        if delayed:
            current = [p.detach().clone() for p in params]
            with torch.no_grad():
                torch._foreach_copy_(params, stale)  # the forward reads w_{t-1}
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if delayed:
            with torch.no_grad():
                torch._foreach_copy_(params, current)  # the update applies to w_t
            stale = current
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(evaluate(model, data, cfg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--lr", type=float, default=None, help="peak lr (default: the preset's)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    for delayed in (False, True):
        losses = [run(s, delayed, args.lr, args.steps) for s in args.seeds]
        print(f"{'delayed' if delayed else 'synchronous':12} held-out "
              + " ".join(f"{v:.4f}" for v in losses), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
