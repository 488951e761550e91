"""Shared helpers: models, seeded grads and the torch.optim.AdamW(fused=True) oracle."""

from __future__ import annotations

import torch

from offloadopt import HybridAdamW

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
