"""An accelerate training loop with HybridAdamW: gradient accumulation, clipping, save_state and
load_state into a fresh Accelerator, against the same loop with torch.optim.AdamW(fused=True).

    python examples/accelerate_loop.py

Prints the largest weight difference from torch's optimizer after 8 optimizer steps (of 2
micro-steps each) with a save/load halfway; exits 1 unless it is 0.0 (fp32 on the CPU: exact).
"""

from __future__ import annotations

import json
import tempfile

import torch
from accelerate import Accelerator

from offloadopt import HybridAdamW


def data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, x.roll(1, dims=1))


def run(make_opt, ckpt: str, steps: int = 8) -> list[torch.Tensor]:
    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
        )
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        loader = torch.utils.data.DataLoader(data(), batch_size=4, shuffle=False)
        model, opt, loader = acc.prepare(model, make_opt(model), loader)
        return acc, model, opt, loader

    acc, model, opt, loader = fresh()
    done = 0
    for _ in range(2):  # two passes over 16 micro-batches: 8 optimizer steps each
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                done += 1
                if done == steps // 2:
                    acc.save_state(ckpt)
                    acc, model, opt, _ = fresh()  # a new process would do the same
                    acc.load_state(ckpt)
        if done >= steps:
            break
    return [p.detach().clone() for p in model.parameters()]


def main() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        ours = run(lambda m: HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1), f"{tmp}/a")
        ref = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), f"{tmp}/b")
    return max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True))


if __name__ == "__main__":
    diff = main()
    print(json.dumps({"max_abs_weight_diff_vs_torch": diff, "exact": diff == 0.0}))
    raise SystemExit(0 if diff == 0.0 else 1)
