"""Shared helpers: models, seeded grads and the torch.optim.AdamW(fused=True) oracle."""

from __future__ import annotations

import torch

from offloadopt import HybridAdamW
from offloadopt.shards import local

FRACTIONS = (0.0, 0.5, 1.0)


def make_params(dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    """Five params above min_offload_numel=64 plus two small ones, in registration order."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (32,), (24, 32), (24,), (16, 24), (16,), (7, 5, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def groups_of(params, **extra):
    """Three groups with different hyperparameters, as a user with decay/no-decay would."""
    return [
        {"params": params[0:2], "lr": 1e-2, "weight_decay": 0.1, **extra},
        {"params": params[2:4], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        {"params": params[4:], "lr": 5e-3, "eps": 1e-6},
    ]


def seeded_grads(params, step: int, dtype=None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(dtype or p.dtype) for p in params]


def hybrid(params, fraction, **kw) -> HybridAdamW:
    kw.setdefault("min_offload_numel", 64)
    return HybridAdamW(groups_of(params), offload_fraction=fraction, **kw)


def assert_bitwise(actual, expected, what=""):
    # CPU paths run the very same kernel on the very same inputs: any difference is a bug.
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(
            a, e, rtol=0, atol=0, msg=lambda m, i=i: f"{what} param {i}: {m}"
        )


class DelayedReference:
    """The delayed parameter update in a few lines, on the CPU: torch.optim.AdamW(fused=True)
    over fp32 masters, fed each step's grads at once; the new weights of the params in
    ``delayed`` (indices) reach them only at the next ``step()`` or ``synchronize()``, the
    others at once. With ``max_grad_norm`` the fp32 grads are multiplied by torch's clip
    coefficient of their global norm (the norm of the per-param fp32 norms, in param order).
    The first ``after`` steps every param gets its new weights at once (``delay_after``)."""

    def __init__(self, params, groups, delayed, max_grad_norm=None, after=0):
        self.params, self.delayed, self.max_grad_norm = list(params), set(delayed), max_grad_norm
        self.after, self.taken = after, 0
        self.masters = [p.detach().float().clone() for p in self.params]
        index = {id(p): i for i, p in enumerate(self.params)}
        self.opt = torch.optim.AdamW(
            [{**g, "params": [self.masters[index[id(p)]] for p in g["params"]]} for g in groups],
            fused=True,
        )
        self.pending = []

    @torch.no_grad()
    def step(self):
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = {i: self.params[i].grad.float() for i in have}
        if self.max_grad_norm is not None and have:
            norms = torch._foreach_norm([self.params[i].grad for i in have], 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack(list(norms)))
            scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            grads = {i: g * scale for i, g in grads.items()}
        self.synchronize()
        for i, m in enumerate(self.masters):
            m.grad = grads.get(i)
        self.opt.step()
        late = self.taken >= self.after
        self.taken += 1
        for i in have:
            p, m = self.params[i], self.masters[i]
            if i in self.delayed and late:
                self.pending.append((p, m.to(p.dtype)))
                p.grad = None  # the update took it
            else:
                p.copy_(m)

    @torch.no_grad()
    def synchronize(self):
        for p, w in self.pending:
            p.copy_(w)
        self.pending = []


class DelayedTorch:
    """The delayed parameter update by hand around torch's AdamW(fused=True) on the params
    themselves (every param offloaded; DDP's or FSDP2's, each rank's shard: tests/dist_job.py):
    the params show the weights one update behind the optimizer's, which live in ``masters``.
    Unlike :class:`DelayedReference` it keeps no fp32 master, clips nothing and delays every
    param from the first step."""

    def __init__(self, model, lr):
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=lr, fused=True)
        self.masters = [local(p).detach().clone() for p in self.params]

    @torch.no_grad()
    def step(self):
        # The forward of step t read w_{t-2}; the update applies its grads to w_{t-1} (the
        # masters) and the params show w_{t-1} until the next step.
        before = self.masters
        for p, m in zip(self.params, before, strict=True):
            local(p).copy_(m)
        self.opt.step()
        self.masters = [local(p).detach().clone() for p in self.params]
        for p, m in zip(self.params, before, strict=True):
            local(p).copy_(m)

    def zero_grad(self):
        self.opt.zero_grad()

    @torch.no_grad()
    def synchronize(self):
        for p, m in zip(self.params, self.masters, strict=True):
            local(p).copy_(m)
