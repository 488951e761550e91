"""PyTorch Lightning with HybridAdamW: fit one epoch, save a checkpoint, then ``fit(ckpt_path=...)``
in a fresh Trainer and module to the end of the second, against the same run with
``torch.optim.AdamW(fused=True)`` (Lightning's own resume semantics, the same for both); then a
twin optimizer loaded from the resumed one's ``state_dict()`` steps in lockstep with it
(Lightning assigns state entries after a resume: the twin shows whether ``state_dict()`` still
reports what the update uses).

    python examples/lightning_resume.py [--device cpu|cuda]

Prints the largest weight difference of the resume and of the twin; exits 1 unless both are 0
(on CUDA the resume against torch within 1e-5: the CPU and CUDA kernels round differently).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import lightning as L
import torch

from offloadopt import HybridAdamW


class Module(L.LightningModule):
    def __init__(self, seed: int = 0, make_opt=None):
        super().__init__()
        self.make_opt = make_opt or hybrid
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def hybrid(params):
    return HybridAdamW(params, lr=1e-2, offload_fraction=0.5, min_offload_numel=1)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.roll(1, 1)), batch_size=8
    )


def trainer(out: str, steps: int, device: str) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator=device, devices=1, default_root_dir=out,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, deterministic=True)  # fmt: skip


def resume_run(out: str, device: str, make_opt):
    """One epoch, a checkpoint, then a fresh module and Trainer resumed to the second's end."""
    half = Module(make_opt=make_opt)
    t = trainer(f"{out}/first", 8, device)
    t.fit(half, loader())
    t.save_checkpoint(f"{out}/half.ckpt")
    resumed = Module(seed=1, make_opt=make_opt)  # a fresh module: the checkpoint brings it back
    t2 = trainer(f"{out}/second", 16, device)
    t2.fit(resumed, loader(), ckpt_path=f"{out}/half.ckpt")
    return resumed, t2.optimizers[0]


def main(device: str = "cpu") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        resumed, opt = resume_run(f"{out}/hybrid", device, hybrid)
        ref, _ = resume_run(f"{out}/torch", device, torch_adamw)  # the same through torch's AdamW
        diff_resume = max((p - q).abs().max().item()
                          for p, q in zip(ref.parameters(), resumed.parameters(), strict=True))  # fmt: skip
        # A twin loaded from the resumed optimizer's state_dict() must step exactly like it.
        # Lightning's teardown moved the module to the CPU; the optimizer's state stays where
        # it lives, so the params go back to the device (in place: the same param objects).
        resumed.to(device)
        twin_model = Module(seed=2).to(device)
        twin_model.load_state_dict(resumed.state_dict())
        twin = hybrid(twin_model.parameters())
        twin.load_state_dict(opt.state_dict())
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p, q in zip(resumed.parameters(), twin_model.parameters(), strict=True):
                p.grad = torch.randn(p.shape, generator=g).to(p.device)
                q.grad = p.grad.clone()
            opt.step()
            twin.step()
        diff_twin = max((p - q).abs().max().item()
                        for p, q in zip(resumed.parameters(), twin_model.parameters(), strict=True))  # fmt: skip
        twin.close()
    return {"resume_vs_torch": diff_resume, "twin": diff_twin}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    device = ap.parse_args().device
    d = main(device)
    # On CUDA torch's AdamW runs its CUDA kernel and HybridAdamW the CPU one for offloaded
    # params: they round differently (tests/cuda/test_optim_cuda.py, GPU_VS_CPU_KERNEL_ATOL).
    tol = 1e-5 if device.startswith("cuda") else 0.0
    exact = d["resume_vs_torch"] <= tol and d["twin"] == 0.0
    print(json.dumps({"max_abs_weight_diff": d, "exact": exact}))
    raise SystemExit(0 if exact else 1)
