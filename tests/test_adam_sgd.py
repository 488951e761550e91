"""HybridAdam and HybridSGD against torch.optim.Adam(fused=True) and torch.optim.SGD(fused=True):
bitwise on CPU fp32 at every fraction, fp32 masters for bf16, checkpoints both ways."""

import copy

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, groups_of, make_params, seeded_grads

from offloadopt import HybridAdam, HybridSGD

SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
    "maximize": dict(lr=0.05, momentum=0.5, maximize=True),
}
ADAM_CASES = {
    "plain": dict(lr=1e-2),
    "l2": dict(lr=1e-2, weight_decay=0.1),
    "maximize": dict(lr=1e-2, weight_decay=0.01, maximize=True, betas=(0.8, 0.9)),
}


def pair(kind, case, fraction, dtype=torch.float32):
    ref_params, params = make_params(dtype), make_params(dtype)
    kw = (SGD_CASES if kind == "sgd" else ADAM_CASES)[case]
    torch_cls, ours = (torch.optim.SGD, HybridSGD) if kind == "sgd" else (torch.optim.Adam, HybridAdam)  # fmt: skip
    masters = ref_params if dtype == torch.float32 else [torch.nn.Parameter(p.detach().float()) for p in ref_params]  # fmt: skip
    ref = torch_cls(groups_of(masters), fused=True, **kw)
    opt = ours(groups_of(params), offload_fraction=fraction, min_offload_numel=64, **kw)
    return ref, masters, opt, params


def run(ref, masters, opt, params, steps, start=0):
    for step in range(start, start + steps):
        for m, p, g in zip(masters, params, seeded_grads(params, step), strict=True):
            m.grad, p.grad = g.float(), g.clone()
        ref.step()
        opt.step()


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize(
    "kind,case", [("sgd", c) for c in SGD_CASES] + [("adam", c) for c in ADAM_CASES]
)
def test_bitwise_equal_to_torchs_fused_kernel_on_cpu_fp32(kind, case, fraction):
    ref, masters, opt, params = pair(kind, case, fraction)
    run(ref, masters, opt, params, 8)
    assert_bitwise(params, masters, f"{kind} {case}")
    if fraction == 1.0 and (kind == "adam" or "momentum" in SGD_CASES[case]):
        assert opt.is_offloaded(params[0])
    for p, m in zip(params, masters, strict=True):
        mine, theirs = opt.state[p], ref.state[m]
        assert set(mine) == set(theirs), (mine.keys(), theirs.keys())  # no "step" for SGD
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("kind,case", [("sgd", "nesterov"), ("adam", "l2")])
def test_bf16_params_update_fp32_masters_like_torch_on_fp32_copies(kind, case, fraction):
    ref, masters, opt, params = pair(kind, case, fraction, torch.bfloat16)
    for step in range(6):
        run(ref, masters, opt, params, 1, start=step)
        assert_bitwise([opt.state[p]["master"] for p in params], masters, f"step {step}")
        assert_bitwise(params, [m.detach().bfloat16() for m in masters], "weights = round(master)")


def test_sgd_without_momentum_has_nothing_to_offload_and_says_so():
    params = make_params()
    opt = HybridSGD(params, lr=0.1, offload_fraction=1.0, min_offload_numel=1)
    assert {pl.reason for pl in opt.placement} == {"no state"}
    assert not any(opt.is_offloaded(p) for p in params)
    assert "no state" in opt.placement_table()
    bf16 = make_params(torch.bfloat16)
    opt = HybridSGD(bf16, lr=0.1, offload_fraction=1.0, min_offload_numel=1)
    assert all(opt.is_offloaded(p) for p in bf16)  # the fp32 master is state


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize("kind,case", [("sgd", "dampening"), ("adam", "l2")])
def test_checkpoints_cross_load_with_torch_both_ways(kind, case, fraction):
    # 10 uninterrupted steps (torch and ours in lockstep) against: 5 steps of each, then
    # torch's state loaded into a fresh ours and ours into a fresh torch, 5 more steps each.
    ref, masters, opt, params = pair(kind, case, fraction)
    run(ref, masters, opt, params, 10)
    t_ref, t_masters, t_opt, t_own = pair(kind, case, fraction)
    run(t_ref, t_masters, t_opt, t_own, 5)
    kw = (SGD_CASES if kind == "sgd" else ADAM_CASES)[case]
    fresh = [torch.nn.Parameter(m.detach().clone()) for m in t_masters]
    ours = (HybridSGD if kind == "sgd" else HybridAdam)(
        groups_of(fresh), offload_fraction=fraction, min_offload_numel=64, **kw
    )
    ours.load_state_dict(copy.deepcopy(t_ref.state_dict()))  # torch -> ours
    back = [torch.nn.Parameter(p.detach().clone()) for p in t_own]
    torch_again = type(t_ref)(groups_of(back), fused=True, **kw)
    torch_again.load_state_dict(copy.deepcopy(t_opt.state_dict()))  # ours -> torch
    assert torch_again.param_groups[0]["fused"] is True
    for step in range(5, 10):
        grads = seeded_grads(fresh, step)
        for a, b, g in zip(fresh, back, grads, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        torch_again.step()
    assert_bitwise(fresh, masters, "torch -> ours")
    assert_bitwise(back, params, "ours -> torch")


def test_adam_refuses_decoupled_weight_decay_and_an_adamw_checkpoint():
    with pytest.raises(ValueError, match="is AdamW: use offloadopt.HybridAdamW"):
        HybridAdam(make_params(), decoupled_weight_decay=True)
    params = make_params()
    torch_adamw = torch.optim.AdamW(params, fused=True)
    opt = HybridAdam(make_params(), min_offload_numel=64)
    with pytest.raises(
        ValueError, match="decoupled_weight_decay=True, which HybridAdam does not support"
    ):
        opt.load_state_dict(torch_adamw.state_dict())


@pytest.mark.parametrize(
    "kw,match",
    [(dict(momentum=-0.1), "Invalid momentum value: -0.1"),
     (dict(lr=-1.0), "Invalid learning rate: -1.0"),
     (dict(nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
     (dict(weight_decay=-1.0), "Invalid weight_decay value: -1.0")],
)  # fmt: skip
def test_sgd_arguments_are_checked_like_torchs(kw, match):
    with pytest.raises(ValueError, match=match):
        HybridSGD(make_params(), **kw)


def refused_at_the_second_step(opt, params, momentum, match):
    """One step, then ``momentum`` set on group 0: the next step() raises ``match`` and no
    param changed."""
    for step in range(2):
        for p, g in zip(params, seeded_grads(params, step), strict=True):
            p.grad = g
        if step == 1:
            opt.param_groups[0]["momentum"] = momentum
            before = [p.detach().clone() for p in params]
            with pytest.raises(ValueError, match=match):
                opt.step()
            assert_bitwise(params, before)
        else:
            opt.step()


def test_turning_momentum_off_once_buffers_exist_is_refused_before_any_change():
    """torch's SGD keeps unused buffers when momentum goes to 0 (and uses them again if it
    comes back); the placement cannot drop or keep them unused: refused, nothing changed."""
    params = make_params()
    opt = HybridSGD(params, lr=0.1, momentum=0.9, min_offload_numel=1)
    refused_at_the_second_step(opt, params, 0.0, "momentum turned on or off after the first step")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_sgd_momentum_turned_on_while_no_state_exists_is_torchs(fraction):
    """SGD without momentum keeps no state, so turning momentum on later (here at step 2) is
    torch's first momentum step: buffers start from the grads, bitwise."""
    ref_params, params = make_params(), make_params()
    ref = torch.optim.SGD(ref_params, lr=0.1, fused=True)
    opt = HybridSGD(params, lr=0.1, offload_fraction=fraction, min_offload_numel=1)
    for step in range(5):
        if step == 2:
            for o in (ref, opt):
                o.param_groups[0]["momentum"] = 0.9
        for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        assert_bitwise(params, ref_params, f"step {step}")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_sgd_with_onecyclelr_turning_momentum_on_before_the_first_step_is_torchs(fraction):
    """A fresh user's finding: OneCycleLR (cycle_momentum=True by default) gives a group built
    with momentum=0 a momentum at construction; torch's SGD starts its buffers at the first
    step, HybridSGD refused. Its params are now placed again (no state yet), bitwise torch's."""
    ref_params, params = make_params(), make_params()
    ref = torch.optim.SGD(ref_params, lr=0.1, fused=True)
    opt = HybridSGD(params, lr=0.1, offload_fraction=fraction, min_offload_numel=1)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=8) for o in (ref, opt)]
    for step in range(6):
        for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        for s in scheds:
            s.step()
        assert_bitwise(params, ref_params, f"step {step}")
    for p, q in zip(ref_params, params, strict=True):
        assert_bitwise([opt.state[q]["momentum_buffer"]], [ref.state[p]["momentum_buffer"]])
    if fraction > 0:
        assert any(opt.is_offloaded(p) for p in params)  # the buffers take host memory now


def test_sgd_without_masters_on_bf16_is_refused_where_torchs_kernel_is_wrong():
    from offloadopt.sgd import low_precision_fused_sgd_is_right

    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    if low_precision_fused_sgd_is_right():
        HybridSGD([p], lr=0.25, momentum=0.5, master_weights=False).close()
    else:
        with pytest.raises(NotImplementedError, match="master_weights=True"):
            HybridSGD([p], lr=0.25, momentum=0.5, master_weights=False)
        q = torch.nn.Parameter(torch.ones(64))
        opt = HybridSGD([q], lr=0.25, momentum=0.5, master_weights=False)
        with pytest.raises(NotImplementedError, match="master_weights=True"):
            opt.add_param_group({"params": [p]})  # a group added later too, and nothing added
        assert len(opt.param_groups) == 1 and not opt.is_offloaded(p)
        opt.close()
    HybridSGD([p], lr=0.25, momentum=0.5).close()  # with fp32 masters: right everywhere


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_momentum_checkpoint_loads_into_sgd_built_without_momentum(fraction):
    """A fresh user's finding: the checkpoint's momentum_buffer was dropped silently when the
    optimizer it was loaded into had been built with momentum=0 (the restart of a OneCycleLR
    run); torch's SGD keeps it. The params are placed again for the loaded values."""
    ref_params, params = make_params(), make_params()
    ref = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9, fused=True)
    opt = HybridSGD(params, lr=0.1, momentum=0.9, offload_fraction=fraction, min_offload_numel=1)
    for p, q, g in zip(ref_params, params, seeded_grads(params, 0), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    opt.step()
    ref2 = torch.optim.SGD(ref_params, lr=0.1, momentum=0.0, fused=True)
    ref2.load_state_dict(ref.state_dict())
    opt2 = HybridSGD(params, lr=0.1, momentum=0.0, offload_fraction=fraction, min_offload_numel=1)
    opt2.load_state_dict(opt.state_dict())
    opt.close()
    for step in range(1, 4):
        for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref2.step()
        opt2.step()
        assert_bitwise(params, ref_params, f"step {step}")
    for p, q in zip(ref_params, params, strict=True):
        assert_bitwise([opt2.state[q]["momentum_buffer"]], [ref2.state[p]["momentum_buffer"]])


def test_momentum_turned_on_under_a_met_budget_is_refused():
    """A fresh user's finding: with max_gpu_memory the placement for the new state kept the
    budget's old fraction, unchecked (more state on the device than the budget allowed)."""
    params = make_params()
    opt = HybridSGD(
        params, lr=0.1, min_offload_numel=1, max_gpu_memory="1GB", activation_bytes=1000
    )
    refused_at_the_second_step(opt, params, 0.9, "need other state than when max_gpu_memory chose")


@pytest.mark.parametrize("cls", ["HybridAdam", "HybridSGD", "HybridAdamW"])
def test_an_unknown_keyword_is_named_with_the_class_the_caller_built(cls):
    # A fresh user's nit: HybridAdam and HybridSGD named their base class, HybridOptimizer.
    import offloadopt

    with pytest.raises(TypeError, match=rf"^{cls}\.__init__\(\) got an unexpected keyword argument 'bogus'"):  # fmt: skip
        getattr(offloadopt, cls)([torch.nn.Parameter(torch.zeros(3))], bogus=1)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_sgd_where_torchs_fused_sgd_breaks(fraction):
    """Two cases the differential fuzz (tests/fuzz.py) met where torch 2.13's fused CPU SGD
    gives no reference: a param whose first grad comes after the others have momentum buffers
    (fused SGD raises TypeError), and a GradScaler skipping the first step (fused SGD keeps the
    empty_like() buffers it made, garbage from then on). HybridSGD does what torch's for-loop
    SGD does, bitwise (fp32 for-loop and fused SGD agree bitwise wherever fused works)."""

    def pair():
        return [torch.nn.Parameter(torch.linspace(-1, 1, 64)), torch.nn.Parameter(torch.ones(64))]

    ps, rs = pair(), pair()
    opt = HybridSGD(ps, lr=0.1, momentum=0.9, dampening=0.2, min_offload_numel=1,
                    offload_fraction=fraction)  # fmt: skip
    ref = torch.optim.SGD(rs, lr=0.1, momentum=0.9, dampening=0.2, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
            g = torch.randn(64, generator=gen)
            p.grad, r.grad = (g.clone(), g.clone()) if i == 0 or step >= 2 else (None, None)
        opt.step()
        ref.step()
        assert_bitwise(ps, rs, f"late first grad, step {step}")
    ps, rs = pair(), pair()
    opt = HybridSGD(ps, lr=0.1, momentum=0.9, min_offload_numel=1, offload_fraction=fraction)
    ref = torch.optim.SGD(rs, lr=0.1, momentum=0.9, foreach=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=4.0) for _ in range(2)]
    for step in range(3):
        for s, params, o in zip(scalers, (ps, rs), (opt, ref), strict=True):
            s.scale(sum((p * torch.linspace(0, 1, 64)).sum() for p in params)).backward()
            if step == 0:
                params[0].grad[3] = float("inf")  # skipped: no state may come of it
            s.step(o)
            s.update()
            o.zero_grad()
        assert_bitwise(ps, rs, f"scaler, step {step}")
    for p, r in zip(ps, rs, strict=True):
        assert_bitwise([opt.state[p]["momentum_buffer"]], [ref.state[r]["momentum_buffer"]])


def test_sgd_without_momentum_saves_no_state_entries_as_torch():
    """A new user's find: HybridSGD without momentum saved ``"state": {0: {}, 1: {}}`` where
    torch's SGD saves ``{}`` (a key-by-key match, as torch.distributed.checkpoint's, differs)."""
    m = torch.nn.Linear(16, 16)
    ref = torch.optim.SGD(m.parameters(), lr=0.1, fused=True)
    opt = HybridSGD(m.parameters(), lr=0.1, offload_fraction=0.5, min_offload_numel=1)
    m(torch.randn(2, 16)).sum().backward()
    ref.step()
    opt.step()
    assert ref.state_dict()["state"] == {} and opt.state_dict()["state"] == {}
    fresh = HybridSGD(m.parameters(), lr=0.1)
    fresh.load_state_dict(opt.state_dict())  # and it loads back
