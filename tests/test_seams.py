"""A param's group is found by identity; hyperparameters are frozen and checked before any state
changes; replaced staging is released at once; bad groups are refused with a clear error."""

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, groups_of, hybrid, make_params, seeded_grads

from offloadopt import HybridAdamW


def pair(fraction):
    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    opt = hybrid(params, fraction)
    return ref, ref_params, opt, params


def step_both(ref, ref_params, opt, params, step):
    for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    opt.step()


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_reordering_param_groups_in_place_keeps_each_params_hyperparameters(fraction):
    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    ref.param_groups.reverse()
    opt.param_groups.reverse()
    for step in range(1, 4):
        step_both(ref, ref_params, opt, params, step)
        assert_bitwise(params, ref_params, f"step {step}")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_popping_a_group_stops_its_updates(fraction):
    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    ref.param_groups.pop(1)
    opt.param_groups.pop(1)
    for step in range(1, 3):
        step_both(ref, ref_params, opt, params, step)
    assert_bitwise(params, ref_params)
    assert opt.state[params[2]]["step"] == 1  # its group was popped after one step


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_param_appended_to_a_named_group_by_hand_is_updated_and_checkpointed(fraction):
    model, ref_model = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ref_model.load_state_dict(model.state_dict())
    extra, ref_extra = (torch.nn.Parameter(torch.ones(128)) for _ in range(2))
    opt = HybridAdamW(model.named_parameters(), offload_fraction=fraction, min_offload_numel=1)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True)
    opt.param_groups[0]["params"].append(extra)
    ref.param_groups[0]["params"].append(ref_extra)
    for _ in range(3):
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, ref)):
            (m(torch.ones(2, 64)).sum() + e.pow(2).sum()).backward()
            o.step()
            o.zero_grad()
    assert_bitwise([*model.parameters(), extra], [*ref_model.parameters(), ref_extra])
    sd = opt.state_dict()
    assert sd["state"][2]["step"] == 3 and not opt.is_offloaded(extra)
    assert opt.placement[-1].reason == "added by hand"


def test_a_param_in_two_groups_is_refused_before_anything_changes():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    opt.param_groups[1]["params"].append(params[0])
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, seeded_grads(params, 1), strict=True):
        p.grad = g
    with pytest.raises(RuntimeError, match="group0.param0 is in param groups 0 and 1"):
        opt.step()
    assert_bitwise(params, before)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize(
    "key,value,match",
    [("eps", None, "param group 2: Invalid epsilon value: None"),
     ("maximize", "yes", "param group 2: Invalid maximize: 'yes'"),
     ("lr", -1.0, "param group 2: Invalid learning rate: -1.0")],
)  # fmt: skip
def test_a_group_value_broken_later_raises_before_any_state_changes(fraction, key, value, match):
    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    steps = {id(p): float(s["step"]) for p, s in opt.state.items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    weights = [p.detach().clone() for p in params]
    opt.param_groups[2][key] = value
    for p, g in zip(params, seeded_grads(params, 1), strict=True):
        p.grad = g
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()
    assert {id(p): float(s["step"]) for p, s in opt.state.items()} == steps
    assert_bitwise([opt.state[p]["exp_avg"] for p in params], moments, "exp_avg")
    assert_bitwise(params, weights, "weights")


def test_staging_replaced_by_add_param_group_is_released_at_once():
    small, big = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(5000))
    opt = HybridAdamW([small], min_offload_numel=1)
    old = opt.debug.pipeline.transfers[torch.device("cpu")]
    opt.add_param_group({"params": [big]})
    new = opt.debug.pipeline.transfers[torch.device("cpu")]
    assert new is not old and new.nbytes == 4 * 5000
    # What the optimizer holds now: 3 arena buffers per arena, and only the new staging.
    arenas = sum(3 * a.nbytes for a in opt.arenas)
    assert opt.host_nbytes == arenas + 2 * new.nbytes
    assert old.ring.buffers.pinned_nbytes == 0


@pytest.mark.parametrize(
    "params,exc,match",
    [
        ({torch.nn.Parameter(torch.randn(4))}, TypeError, "sets will change between runs"),
        ([{"params": {torch.nn.Parameter(torch.randn(4))}}], TypeError, "is a set; use a list"),
        ([{"lr": 0.1}], ValueError, r"must have a 'params' key .*got keys \['lr'\]"),
        ([{"params": [torch.nn.Parameter(torch.randn(4))], "maximize": "yes"}], ValueError,
         "Invalid maximize: 'yes'"),
    ],
)  # fmt: skip
def test_bad_params_and_groups_are_refused_with_the_value_named(params, exc, match):
    with pytest.raises(exc, match=match):
        HybridAdamW(params)


def test_an_offloaded_param_rebound_to_non_contiguous_data_is_named_and_nothing_changes():
    p = torch.nn.Parameter(torch.randn(64, 32))
    opt = HybridAdamW([p], lr=1e-2, offload_fraction=1.0, min_offload_numel=1)
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = p.data.t().contiguous().t()  # same values and shape, column-major
    weights, state = p.detach().clone(), opt.state_dict()
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match=r"group0.param0 is not contiguous .*strides \(1, 64\)"):
        opt.step()  # was: the worker's view error, naming no param
    assert torch.equal(p.detach(), weights)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in state["state"][0].items())
    p.data = p.data.contiguous()
    opt.step()  # and the optimizer goes on
    opt.close()


def test_a_non_contiguous_param_on_the_device_steps_as_with_torch():
    w = torch.randn(32, 64)
    p = torch.nn.Parameter(w.clone().t())  # column-major from the start
    ref = torch.nn.Parameter(w.clone().t())
    opt = HybridAdamW([p], lr=1e-2, offload_fraction=1.0, min_offload_numel=1)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    assert opt.placement[0].reason == "non-contiguous"  # kept on the device
    for _ in range(2):
        g = torch.randn(64, 32)
        # grads with the param's strides, as autograd makes them
        p.grad, ref.grad = torch.empty_like(p).copy_(g), torch.empty_like(ref).copy_(g)
        opt.step()
        torch_opt.step()
    assert not p.is_contiguous()
    assert_bitwise([p], [ref], "non-contiguous param on the device")
    opt.close()
