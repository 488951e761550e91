"""HybridAdamW under Lightning's mixed precision, as docs/caveats.md says to use it: the
optimizer unscales inside ``step()`` (``_step_supports_amp_scaling``, as torch's fused AdamW),
so Lightning refuses its own clipping (``gradient_clip_val``) under ``16-mixed`` and
``bf16-mixed``; ``max_grad_norm`` clips in the optimizer instead, bitwise Lightning's own
clipping of torch's fused AdamW under ``32-true`` (a new user's find: the docs said to clip
with the framework)."""

from __future__ import annotations

import pytest
import torch

from offloadopt import HybridAdamW

L = pytest.importorskip("lightning")


class Module(L.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 16))  # fmt: skip
        self.make_opt = make_opt

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y) * 100  # large grads: the clip acts

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(1, 1)),
                                       batch_size=8)  # fmt: skip


def fit(tmp_path, make_opt, precision, clip):
    module = Module(make_opt)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, precision=precision,
                        gradient_clip_val=clip, default_root_dir=str(tmp_path),
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module, loader())
    return [p.detach().clone() for p in module.parameters()]


def hybrid(**kw):
    return lambda params: HybridAdamW(params, lr=1e-2, offload_fraction=0.5,
                                      min_offload_numel=1, **kw)  # fmt: skip


@pytest.mark.slow
def test_mixed_precision_clips_in_the_optimizer_as_lightning_clips_in_fp32(tmp_path):
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(tmp_path, hybrid(), "bf16-mixed", 1.0)  # Lightning's refusal, as for torch's fused
    fit(tmp_path, hybrid(max_grad_norm=1.0), "bf16-mixed", 0.0)  # runs
    ours = fit(tmp_path, hybrid(max_grad_norm=1.0), "32-true", 0.0)
    theirs = fit(tmp_path, lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
                 "32-true", 1.0)  # fmt: skip
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
