"""Scenarios from real bug reports (cases C01-C15, one test each), on the CPU."""

import pytest
import torch
from oracle import FRACTIONS

from offloadopt import HybridAdamW


def adamw_pair(make, fraction, **kw):
    """The same params twice: one for torch's fused AdamW, one for HybridAdamW."""
    torch.manual_seed(0)
    ref_model = make()
    torch.manual_seed(0)
    model = make()
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True, **kw)
    opt = HybridAdamW(
        model.named_parameters(), offload_fraction=fraction, min_offload_numel=1, **kw
    )
    return ref_model, ref, model, opt


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c04_grads_of_several_backward_passes_accumulate(fraction):
    w = torch.nn.Parameter(torch.zeros(()))
    opt = HybridAdamW([w], offload_fraction=fraction, min_offload_numel=1, betas=(0.9, 0.999))
    ref_w = torch.nn.Parameter(torch.zeros(()))
    ref = torch.optim.AdamW([ref_w], fused=True, betas=(0.9, 0.999))
    for _ in range(3):
        w.backward()  # loss = w: grad 1 each time, summed to 3
        ref_w.backward()
    opt.step()
    ref.step()
    assert opt.is_offloaded(w) == (fraction > 0)
    torch.testing.assert_close(
        opt.state[w]["exp_avg"], torch.tensor(0.3), rtol=0, atol=1e-7
    )  # (1 - 0.9) x 3
    torch.testing.assert_close(opt.state[w]["exp_avg"], ref.state[ref_w]["exp_avg"], rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)


def test_c05_clip_with_accumulation_is_identical_at_every_fraction():
    results = []
    for fraction in FRACTIONS:
        w = torch.nn.Parameter(torch.zeros(2))
        opt = HybridAdamW([w], offload_fraction=fraction, min_offload_numel=1)
        (w * torch.tensor([3.0, 0.0])).sum().backward()
        (w * torch.tensor([0.0, 4.0])).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_([w], max_norm=1.0)
        assert norm.item() == 5.0
        # torch's clip coefficient is max_norm / (norm + 1e-6)
        torch.testing.assert_close(w.grad, torch.tensor([0.5999999, 0.7999998]), rtol=0, atol=1e-7)
        applied = w.grad.clone()
        opt.step()
        torch.testing.assert_close(opt.state[w]["exp_avg"], 0.1 * applied, rtol=1e-6, atol=0)
        results.append((w.detach().clone(), opt.state[w]["exp_avg"].clone()))
    for w_, m in results[1:]:
        torch.testing.assert_close(w_, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(m, results[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c06_frozen_weight_gets_no_host_buffer_and_stays(fraction):
    def make():
        lin = torch.nn.Linear(64, 64)
        lin.weight.requires_grad_(False)
        return lin

    ref_lin, ref, lin, opt = adamw_pair(make, fraction)
    frozen = lin.weight.detach().clone()
    assert not opt.is_offloaded(lin.weight)
    assert opt.is_offloaded(lin.bias) == (fraction > 0)
    assert all(a.numel == 64 for a in opt.arenas)
    x = torch.randn(4, 64)
    for _ in range(3):
        for m, o in ((ref_lin, ref), (lin, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    torch.testing.assert_close(lin.weight, frozen, rtol=0, atol=0)
    torch.testing.assert_close(lin.bias, ref_lin.bias, rtol=0, atol=0)
    assert lin.weight not in opt.state


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c07_tied_weights_have_one_state_entry(fraction):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.emb, self.head = self, self  # one Parameter used twice

        def forward(self):
            return 2 * self.emb.w + 3 * self.head.w

    m = Tied()
    opt = HybridAdamW(m.named_parameters(), offload_fraction=fraction, min_offload_numel=1)
    m().backward()
    opt.step()
    assert len(opt.state) == 1 and m.emb.w is m.head.w
    torch.testing.assert_close(opt.state[m.w]["exp_avg"], torch.tensor(0.5), rtol=0, atol=1e-7)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c08_mixed_dtypes(fraction):
    lin = torch.nn.Linear(8, 8).bfloat16()
    extra = torch.nn.Parameter(torch.randn(8))
    params = [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("extra", extra)]
    masters = [torch.nn.Parameter(p.detach().float()) for _, p in params]
    ref = torch.optim.AdamW(masters, fused=True)
    opt = HybridAdamW(params, offload_fraction=fraction, min_offload_numel=1)
    x = torch.randn(3, 8)
    for _ in range(4):
        opt.zero_grad()
        (lin(x.bfloat16()).float().sum() + (extra * x).sum()).backward()
        for m, (_, p) in zip(masters, params, strict=True):
            m.grad = p.grad.float()
        ref.step()
        opt.step()
        assert "master" not in opt.state[extra]
        for m, (_, p) in zip(masters, params, strict=True):
            torch.testing.assert_close(p.detach(), m.detach().to(p.dtype), rtol=0, atol=0)
        for p in (lin.weight, lin.bias):
            torch.testing.assert_close(
                p.detach(), opt.state[p]["master"].to(torch.bfloat16), rtol=0, atol=0
            )


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c13_empty_and_zero_size_params(fraction):
    lin = torch.nn.Linear(8, 8).bfloat16()
    empty = torch.nn.Parameter(torch.zeros(0, 8, dtype=torch.bfloat16))
    opt = HybridAdamW(
        [{"params": list(lin.parameters()) + [empty]}, {"params": []}],
        offload_fraction=fraction,
        min_offload_numel=0,
    )
    assert not opt.is_offloaded(empty)
    for _ in range(2):
        opt.zero_grad()
        (lin(torch.randn(2, 8).bfloat16()).sum() + empty.sum()).backward()
        opt.step()
    assert empty.shape == (0, 8) and lin.weight.shape == (8, 8)
    for p in (lin.weight, lin.bias):
        assert torch.isfinite(p).all() and all(
            torch.isfinite(v).all() for v in opt.state[p].values()
        )


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_c11_lr_scheduler_moves_offloaded_and_device_params_alike():
    a, b = torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(64))
    opt = HybridAdamW(
        [{"params": [a]}, {"params": [b], "offload": False}], lr=0.1, min_offload_numel=1
    )
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.is_offloaded(a) and not opt.is_offloaded(b)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    sched.step()
    sched.step()
    assert opt.defaults["lr"] == 0.1
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.025]
    a.grad, b.grad = torch.ones(64), torch.ones(64)
    opt.step()
    # First AdamW step moves by lr * sign(grad) (up to eps): lr x 0.25.
    torch.testing.assert_close(a.detach(), torch.full((64,), -0.025), rtol=1e-6, atol=0)
    torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=0)


def test_c12_add_param_group_places_the_new_group():
    a = torch.nn.Parameter(torch.zeros(8192))
    opt = HybridAdamW([a], lr=1e-3)
    new = torch.nn.Parameter(torch.zeros(4096))
    opt.add_param_group({"params": [new], "lr": 1e-2})
    assert opt.is_offloaded(new) and opt.placement[-1].name == "group1.param0"
    assert opt.param_groups[1]["lr"] == 1e-2 and opt.param_groups[1]["offload"] is None
    a.grad, new.grad = torch.ones_like(a), torch.ones_like(new)
    opt.step()
    torch.testing.assert_close(new.detach(), torch.full((4096,), -1e-2), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.detach(), torch.full((8192,), -1e-3), rtol=1e-5, atol=0)
    sd = opt.state_dict()
    assert sd["param_groups"][1]["params"] == [1] and 1 in sd["state"]


def test_c12_add_param_group_rejects_bad_groups_without_a_trace():
    a = torch.nn.Parameter(torch.zeros(8))
    opt = HybridAdamW([a])
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8))], "lr": -1})
    assert len(opt.param_groups) == 1 and len(opt.placement) == 1


def test_c15_sparse_embedding_raises_at_first_step_naming_the_param():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = HybridAdamW([("embedding.weight", emb.weight)], min_offload_numel=1)
    emb(torch.tensor([0, 3])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients: embedding.weight"):
        opt.step()


def test_c12_a_larger_added_group_grows_the_staging_and_stays_exact():
    small, big = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(5000))
    ref_small, ref_big = (torch.nn.Parameter(p.detach().clone()) for p in (small, big))
    opt = HybridAdamW([small], min_offload_numel=1)
    ref = torch.optim.AdamW([ref_small], fused=True)
    opt.add_param_group({"params": [big], "lr": 1e-2})
    ref.add_param_group({"params": [ref_big], "lr": 1e-2})
    assert opt.debug.pipeline.transfers[torch.device("cpu")].nbytes >= 4 * 5000
    for _ in range(3):
        for p, q in ((small, ref_small), (big, ref_big)):
            p.grad = q.grad = torch.randn(p.shape)
        opt.step()
        ref.step()
    torch.testing.assert_close(big, ref_big, rtol=0, atol=0)
    torch.testing.assert_close(small, ref_small, rtol=0, atol=0)
