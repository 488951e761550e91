"""bf16 over the link (offloadopt/link/transfer.py, Transfer's docstring): under a compressed
representation with fp32 masters, a bf16 param's grads cross D2H in bf16 and its new weights
cross H2D in bf16, written by offloadopt's kernel into the host staging slot over the grads.
That path must give the bits of the fp32 one (grads upcast and weights downcast on the device)
in every mode, with clipping, and with a GradScaler's skipped steps, and move half the bytes.
Without CUDA the copies are plain CPU copies through the same slots and views."""

from __future__ import annotations

import pytest
import torch

from offloadopt import HybridAdamW
from offloadopt.link import transfer
from offloadopt.place import placer

MODES = {
    "step": {},
    "backward": dict(overlap="backward", grads_final=True),
    "delayed": dict(overlap="delayed"),
    "clipped": dict(max_grad_norm=0.05),  # the clip bites: the fp32 path then
    "small-buckets": dict(bucket_nbytes=4096),  # params cut across buckets, slots reused
}


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Linear(96, 8)
    ).to(torch.bfloat16)


def batch(step):
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def copied(monkeypatch) -> dict[str, int]:
    """The bytes the transfers' copies move each way, summed as they start (``opt.stats``
    counts bytes over a link: none without CUDA, where the copies are host to host): each
    copy's elements in the dtype its slot holds (``slot.link``, set by the D2H; an H2D reads
    it where the slot holds the new weights, else the master)."""
    seen = {"d2h": 0, "h2d": 0}
    start_d2h, start_h2d = transfer.Transfer.start_d2h, transfer.Transfer.start_h2d

    def d2h(self, b, idx, grads, slot, *args, **kwargs):
        done = start_d2h(self, b, idx, grads, slot, *args, **kwargs)
        seen["d2h"] += b.link_nbytes(slot.link)
        return done

    def h2d(self, b, idx, slot, *args, **kwargs):
        seen["h2d"] += b.link_nbytes(slot.link if slot.holds_weights(b) else b.arena.dtype)
        return start_h2d(self, b, idx, slot, *args, **kwargs)

    monkeypatch.setattr(transfer.Transfer, "start_d2h", d2h)
    monkeypatch.setattr(transfer.Transfer, "start_h2d", h2d)
    return seen


def train(link: bool, monkeypatch, steps=5, scaler=None, inf_at=(), **kw):
    monkeypatch.setattr(placer, "BF16_LINK", link)
    seen = copied(monkeypatch)
    m = model()
    kw.setdefault("state_dtype", "int8")
    opt = HybridAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, offload_fraction=1.0,
                      min_offload_numel=1, **kw)  # fmt: skip
    if kw.get("overlap") == "delayed":
        opt.watch(m)
    for step in range(steps):
        loss = m(batch(step)).float().pow(2).mean()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
        if step in inf_at:
            next(m.parameters()).grad[0, 0] = float("inf")
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        assert opt.stats.get("d2h_nbytes", 0) == opt.stats.get("h2d_nbytes", 0) == 0  # no link
    opt.synchronize()
    nbytes = (seen["d2h"], seen["h2d"])  # every copy of the run has started
    weights = [p.detach().clone() for p in m.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
    arenas = [(a.dtype, a.link_dtype) for a in opt.arenas]
    opt.close()
    return weights, state, nbytes, arenas


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, msg=k)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_over_the_link_gives_the_bits_of_fp32_over_it(mode, monkeypatch):
    w1, s1, n1, arenas = train(True, monkeypatch, **MODES[mode])
    w0, s0, n0, plain = train(False, monkeypatch, **MODES[mode])
    assert_same(w1, w0)
    assert_same(s1, s0)
    assert arenas and all(a == (torch.float32, torch.bfloat16) for a in arenas)
    assert all(a == (torch.float32, torch.float32) for a in plain)
    params = sum(p.numel() for p in model().parameters())
    (d2h, h2d), (d2h0, h2d0) = n1, n0
    # fp32 both ways, 5 steps (elements: the params, each starting at a 256-element block)
    assert d2h0 == h2d0 and 5 * 4 * params <= d2h0 < 5 * 4 * (params + 256 * 6)
    if mode == "clipped":  # grads multiplied on the device in fp32: fp32 as before
        assert (d2h, h2d) == (d2h0, h2d0)
    else:
        assert (d2h, h2d) == (d2h0 // 2, h2d0 // 2)


def test_a_skipped_step_leaves_the_weights_and_is_the_same_bits(monkeypatch):
    """A GradScaler step with an inf grad skips the update: the slot then holds grads, not new
    weights, and what crosses H2D must be the unchanged weights."""

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    w1, s1, _, _ = train(True, monkeypatch, steps=6, scaler=scaler(), inf_at=(2, 3))
    w0, s0, _, _ = train(False, monkeypatch, steps=6, scaler=scaler(), inf_at=(2, 3))
    assert_same(w1, w0)
    assert_same(s1, s0)


def test_only_bf16_params_under_offloadopts_kernel_use_it(monkeypatch):
    """fp32 params, and the fp32 default (torch's kernel takes fp32 grads only), keep fp32 over
    the link; a group mixing fp32 and bf16 params gets one arena per link dtype."""
    monkeypatch.setattr(placer, "BF16_LINK", True)
    m = model()
    m[0].float()
    opt = HybridAdamW(m.parameters(), state_dtype="int8", offload_fraction=1.0,
                      min_offload_numel=1)  # fmt: skip
    assert sorted((str(a.dtype), str(a.link_dtype)) for a in opt.arenas) == [
        ("torch.float32", "torch.bfloat16"), ("torch.float32", "torch.float32")]  # fmt: skip
    opt.close()
    for kw in ({}, dict(master_weights="bf16-sr", state_dtype="int8")):
        opt = HybridAdamW(model().parameters(), offload_fraction=1.0, min_offload_numel=1, **kw)
        assert all(a.link_dtype == a.dtype for a in opt.arenas)
        opt.close()


def test_the_kernel_writes_the_weights_over_their_own_grads():
    """weights_out may be the grads' memory (what the staging slot does): the same result as
    a separate buffer, and the masters' round to nearest even."""
    from offloadopt.kernels import load, torch_vec_size

    n = 3 * 256 + 17
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    results = []
    for aliased in (False, True):
        m, gr = master.clone(), grad.clone()
        codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.zeros(-(-n // 256)) for _ in range(2)]
        out = gr if aliased else torch.empty(n, dtype=torch.bfloat16)
        load().adam_step([m], [gr], [codes[0]], [codes[1]], [scales[0]], [scales[1]], [out],
                         [1.0], [0], [0], 1e-2, 0.9, 0.999, 0.1, 1e-8, False, True, None, 2,
                         False, torch_vec_size(), True)  # fmt: skip
        results.append((m, out.clone()))
    assert_same(results[1], results[0])
    assert_same([results[0][1]], [results[0][0].to(torch.bfloat16)])
