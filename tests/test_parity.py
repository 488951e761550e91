"""The CPU stands in for the device: the whole offloaded data path against the fused oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import FRACTIONS, assert_bitwise, groups_of, hybrid, make_params, seeded_grads

from offloadopt import HybridAdamW


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_fp32_bitwise_equal_to_torch_fused_adamw(fraction):
    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    opt = hybrid(params, fraction)
    for step in range(20):
        for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        assert_bitwise(params, ref_params, f"step {step}")
    for p, q in zip(ref_params, params, strict=True):
        assert_bitwise(
            [opt.state[q]["exp_avg"], opt.state[q]["exp_avg_sq"]],
            [ref.state[p]["exp_avg"], ref.state[p]["exp_avg_sq"]],
        )
        assert opt.state[q]["step"].item() == ref.state[p]["step"].item() == 20


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_masters_equal_fused_adamw_on_fp32_copies(fraction, dtype):
    params = make_params(dtype)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref = torch.optim.AdamW(groups_of(masters), fused=True)
    opt = hybrid(params, fraction)
    for step in range(20):
        grads = seeded_grads(params, step)
        for m, p, g in zip(masters, params, grads, strict=True):
            m.grad, p.grad = g.float(), g.clone()
        ref.step()
        opt.step()
        assert_bitwise(params, [m.detach().to(dtype) for m in masters], f"step {step}")
    for m, p in zip(masters, params, strict=True):
        assert_bitwise([opt.state[p]["master"]], [m.detach()])
        assert opt.state[p]["master"].dtype == torch.float32


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_master_weights_false_updates_in_param_dtype_like_torch(fraction):
    ref_params, params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    opt = hybrid(params, fraction, master_weights=False)
    for step in range(10):
        for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert_bitwise(params, ref_params)
    assert all("master" not in opt.state[p] for p in params)
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)


@pytest.mark.parametrize("fraction,expected", [(0.0, 0), (0.5, None), (1.0, 4)])
def test_fraction_really_offloads_and_state_is_separate_storage(fraction, expected):
    params = make_params()
    opt = hybrid(params, fraction)
    for p, g in zip(params, seeded_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    host = [pl for pl in opt.placement if pl.offloaded]
    if expected is None:
        assert 0 < len(host) < 4
    else:
        assert len(host) == expected
    # The biases (32, 24 and 16 elements) are below min_offload_numel=64: always on the device.
    small = {pl.name for pl in opt.placement if pl.reason == "small"}
    assert small == {"group0.param1", "group1.param1", "group2.param1"}
    assert not small & {pl.name for pl in host}
    for pl, p in zip(opt.placement, params, strict=True):
        assert opt.is_offloaded(p) == pl.offloaded
        if pl.offloaded:
            rec = opt.debug.records[p]
            storages = {
                rec.arena.master.untyped_storage().data_ptr(),
                rec.arena.states["exp_avg"].untyped_storage().data_ptr(),
            }
            assert p.untyped_storage().data_ptr() not in storages
            assert (
                opt.state[p]["exp_avg"].untyped_storage().data_ptr()
                == rec.arena.states["exp_avg"].untyped_storage().data_ptr()
            )
            # The host copy is what the kernel updates: it equals the param, in its own memory.
            assert torch.equal(rec.home("master"), p.detach())


@pytest.mark.parametrize("bucket_nbytes", [4 * 97, 4 * 1000, 2**20])
def test_buckets_cutting_through_params_change_nothing(bucket_nbytes):
    """Bucket boundaries at odd offsets inside params: still bitwise torch's fused AdamW."""
    ref_params, params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_params]
    ref = torch.optim.AdamW(groups_of(masters), fused=True)
    opt = hybrid(params, 1.0, bucket_nbytes=bucket_nbytes)
    if bucket_nbytes == 4 * 97:
        assert any(b.segments[0].lo > 0 for b in opt.buckets)  # some param really is cut
    for step in range(6):
        for m, p, g in zip(masters, params, seeded_grads(params, step), strict=True):
            m.grad, p.grad = g.float(), g.clone()
        ref.step()
        opt.step()
    assert_bitwise(params, [m.detach().bfloat16() for m in masters])
    assert all(opt.state[p]["step"].item() == 6 for p in params)


def test_placement_is_last_registered_first_and_by_state_bytes():
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(4)]
    opt = HybridAdamW(params, offload_fraction=0.5, min_offload_numel=1)
    assert [pl.where for pl in opt.placement] == ["device", "device", "host", "host"]
    opt = HybridAdamW(params, offload_fraction=0.25, min_offload_numel=1)
    assert [pl.where for pl in opt.placement] == ["device", "device", "device", "host"]
    assert "state on host: 0.000 MB" not in opt.placement_table()


def test_forced_groups_do_not_count_toward_the_fraction():
    a, b, c = (torch.nn.Parameter(torch.zeros(100)) for _ in range(3))
    opt = HybridAdamW(
        [{"params": [a], "offload": True}, {"params": [b]}, {"params": [c], "offload": False}],
        offload_fraction=0.0,
        min_offload_numel=1,
    )
    assert [pl.where for pl in opt.placement] == ["host", "device", "device"]
    assert [pl.reason for pl in opt.placement] == ["forced", "fraction", "forbidden"]
    opt = HybridAdamW(
        [{"params": [a], "offload": False}, {"params": [b]}, {"params": [c]}],
        offload_fraction=0.5,
        min_offload_numel=1,
    )
    assert [pl.where for pl in opt.placement] == ["device", "device", "host"]


def test_a_groups_offload_key_changed_after_placement_is_refused_at_the_next_step():
    # A user's find: the new value was silently ignored (placement is made at construction).
    a, b = (torch.nn.Parameter(torch.randn(100)) for _ in range(2))
    opt = HybridAdamW([{"params": [a]}, {"params": [b], "offload": False}], min_offload_numel=1)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    before = [a.clone(), b.clone(), *(v.clone() for p in (a, b) for v in opt.state[p].values())]
    opt.param_groups[1]["offload"] = True
    with pytest.raises(ValueError, match=r"param group 1: 'offload' changed from False to True.*"
                       "placement is fixed at construction"):  # fmt: skip
        opt.step()
    after = [a, b, *(v for p in (a, b) for v in opt.state[p].values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))  # nothing changed
    opt.set_offload_fraction(1.0)  # a move keeps the placement the group was built with
    assert [pl.where for pl in opt.placement] == ["host", "device"]
    with pytest.raises(ValueError, match="param group 1: 'offload'"):
        opt.step()
    opt.param_groups[1]["offload"] = False  # set back: steps again
    opt.step()
    assert int(opt.state[a]["step"]) == int(opt.state[b]["step"]) == 2


def test_named_parameters_give_names_in_placement():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = HybridAdamW(model.named_parameters(), min_offload_numel=1)
    assert [pl.name for pl in opt.placement] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert "1.weight" in opt.placement_table()


@settings(max_examples=12, deadline=None, database=None)
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    bucket_nbytes=st.integers(256, 3000),
    master=st.booleans(),
)
def test_any_bucket_cutting_is_bitwise_torch(sizes, bucket_nbytes, master):
    """Random param sizes and bucket sizes: cuts land at kernel-aligned offsets, so every
    element is updated exactly as in torch's whole-tensor call (found by a fresh user: cuts
    at unaligned offsets put elements on the kernel's scalar tail path, 1 ulp off)."""
    gen = torch.Generator().manual_seed(sum(sizes) + bucket_nbytes)
    dtype = torch.bfloat16 if master else torch.float32
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    refs = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = HybridAdamW(params, lr=1e-2, min_offload_numel=1, bucket_nbytes=bucket_nbytes)
    ref = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    for _ in range(8):
        for p, r in zip(params, refs, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.to(dtype), g.to(dtype).float()
        opt.step()
        ref.step()
    assert_bitwise(params, [r.detach().to(dtype) for r in refs])


def test_cuts_at_unaligned_offsets_regression():
    """A fresh user's reproducer: 3 x 100 elements, 256-byte buckets. Cut at element 28 of a
    param, its first 28 elements took the kernel's scalar tail path and came out 1 ulp off."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(100)) for _ in range(3)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = HybridAdamW(params, lr=1e-2, min_offload_numel=1, bucket_nbytes=256)
    ref = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    for _ in range(30):
        for p, r in zip(params, refs, strict=True):
            g = torch.randn(100)
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref.step()
    assert_bitwise(params, refs)


def test_back_to_back_segments_join_into_one_kernel_call_bitwise(monkeypatch):
    """The worker joins runs of back-to-back segments (lengths a multiple of CUT_ALIGN, equal
    steps) into one flat kernel operand. Mixed lengths (64-multiples and not), params that miss
    a step (a gap in the bucket, then a step behind) must still be bitwise torch's per-param
    call."""
    from offloadopt.rules import AdamWRule

    calls = []
    kernel = AdamWRule.kernel

    def counting(weights, *args, **kwargs):
        calls.append([w.numel() for w in weights])
        return kernel(weights, *args, **kwargs)

    monkeypatch.setattr(AdamWRule, "kernel", staticmethod(counting))
    gen = torch.Generator().manual_seed(5)
    sizes = [128, 192, 100, 64, 256, 37, 320, 64]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = HybridAdamW(params, lr=1e-2, min_offload_numel=1, bucket_nbytes=2**20)
    ref = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    for step in range(8):
        for i, (p, r) in enumerate(zip(params, refs, strict=True)):
            g = torch.randn(p.shape, generator=gen)
            skip = (i, step) in ((4, 0), (6, 3))  # a step behind from then on
            p.grad, r.grad = (None, None) if skip else (g, g.clone())
        opt.step()
        ref.step()
        assert_bitwise(params, refs, f"step {step}")
    assert opt.state[params[4]]["step"].item() == opt.state[params[6]]["step"].item() == 7
    # Arena order is last-registered first: 64, 320 (a step behind), 37, 256 (a step behind),
    # 64, 100, 192, 128. At step 3 the 320 had no grad: the 64 before it and the 37 after it
    # are not back to back and must not join across it (its state would take an update from
    # whatever the staging slot held there). At the last step: 64, 320, 37 and 256
    # alone (steps differ, or 37 is no 64-multiple), then 64+100 and 192+128.
    assert calls[-1] == [64, 320, 37, 256, 64 + 100, 192 + 128]
    for p, r in zip(params, refs, strict=True):
        assert_bitwise([opt.state[p]["exp_avg_sq"]], [ref.state[r]["exp_avg_sq"]])


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_max_grad_norm_with_a_0d_bf16_param_without_masters(fraction):
    """master_weights=False, a 0-d bf16 param and max_grad_norm: the clip factor (0-d fp32)
    times the 0-d bf16 grad promoted to fp32, and torch's fused kernel refused the mix
    ('expected scalar type BFloat16 but found Float'). Found by the differential fuzz
    (tests/fuzz.py, seed 50029). Against torch on the bf16 params with the grads clipped as the
    README says: fp32 norms, the coefficient applied in fp32, one rounding to bf16."""
    shapes = [(), (5,), (3, 4)]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = HybridAdamW(params, lr=1e-2, master_weights=False, max_grad_norm=0.1,
                      offload_fraction=fraction, min_offload_numel=1)  # fmt: skip
    ref = torch.optim.AdamW(refs, lr=1e-2, fused=True)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        coef = torch.clamp(
            0.1 / (torch.linalg.vector_norm(torch.stack(list(norms))) + 1e-6), max=1.0
        )
        for p, r, g in zip(params, refs, grads, strict=True):
            p.grad, r.grad = g.clone(), (g.float() * coef).bfloat16()
        opt.step()
        ref.step()
        assert_bitwise(params, refs)
    opt.close()
