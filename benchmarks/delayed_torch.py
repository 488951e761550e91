"""Is the delayed update's convergence gap (issue 9) the algorithm's or ours? Plain
``torch.optim.AdamW(fused=True)`` whose forward reads the weights one step old
(w_{t+1} = AdamW(w_t, grad at w_{t-1}), the delayed parameter update's semantics: docs/modes.md,
"The delayed parameter update"), against the same optimizer synchronous, on the main job's tiny
preset, data, schedule and clipping. No offloadopt code runs in the update.

    python benchmarks/delayed_torch.py [--seeds 0 1] [--lr 3e-3] [--after N] [--extrapolate]

``--after N``: the first N steps synchronous, then delayed. ``--extrapolate``: the delayed
forward reads 2 w_{t-1} - w_{t-2}, a linear guess at w_t (the weights being computed).
Prints the final held-out loss (nats) per seed for both.
"""

from __future__ import annotations

import argparse

import torch

from offloadopt.harness import checks
from offloadopt.harness.data import get_batch
from offloadopt.harness.gpt import GPT, PRESETS
from offloadopt.harness.train import TrainConfig, evaluate, lr_at


def run(seed: int, delayed: bool, lr: float | None, steps: int, after: int = 0,
        extrapolate: bool = False) -> float:  # fmt: skip
    cfg = TrainConfig(steps=steps, seed=seed, lr=lr, eval_every=steps, progress=False).resolved()
    torch.manual_seed(cfg.seed)
    model = GPT(PRESETS[cfg.preset])
    data = checks.text_data(cfg.data, cfg.seq_len)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=True)  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    stale = [p.detach().clone() for p in params]  # what the next forward reads: w_{t-1}
    older = [w.clone() for w in stale]  # w_{t-2}, for --extrapolate
    for step in range(1, cfg.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        x, y = get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, "cpu")
        late = delayed and step > after
        if late:
            current = [p.detach().clone() for p in params]
            with torch.no_grad():  # the forward reads w_{t-1} (or its extrapolation)
                guess = (
                    [2 * a - b for a, b in zip(stale, older, strict=True)] if extrapolate else stale
                )
                torch._foreach_copy_(params, guess)
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if late:
            with torch.no_grad():
                torch._foreach_copy_(params, current)  # the update applies to w_t
            older, stale = stale, current
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not late:  # synchronous so far: the next forward reads the weights just made
            older, stale = stale, [p.detach().clone() for p in params]
    return float(evaluate(model, data, cfg))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--lr", type=float, default=None, help="peak lr (default: the preset's)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--after", type=int, default=0, help="synchronous steps before the delay")
    ap.add_argument("--extrapolate", action="store_true", help="forward reads 2 w_{t-1} - w_{t-2}")
    args = ap.parse_args()
    for delayed in (False, True):
        losses = [run(s, delayed, args.lr, args.steps, args.after, args.extrapolate)
                  for s in args.seeds]  # fmt: skip
        print(f"{'delayed' if delayed else 'synchronous':12} held-out "
              + " ".join(f"{v:.4f}" for v in losses), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
