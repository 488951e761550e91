"""opt.state as frameworks use it: assigned entries land in the optimizer's own buffers (host
state stays on the host), deleted entries reset, and state_dict() reports what the update uses."""

import copy

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, groups_of, hybrid, make_params, seeded_grads


def step_both(ref, ref_params, opt, params, step):
    for p, q, g in zip(ref_params, params, seeded_grads(params, step), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    opt.step()


def pair(fraction):
    ref_params, params = make_params(), make_params()
    return (
        torch.optim.AdamW(groups_of(ref_params), fused=True),
        ref_params,
        hybrid(params, fraction),
        params,
    )


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_assigning_state_entries_like_lightning_copies_into_the_buffers(fraction):
    ref, ref_params, opt, params = pair(fraction)
    for step in range(2):
        step_both(ref, ref_params, opt, params, step)
    homes = {p: opt.state[p]["exp_avg"].data_ptr() for p in params}
    for o in (ref, opt):  # Lightning's move to the device after a resume: new tensors assigned
        for state in o.state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = value.clone() * 0.5
    assert {p: opt.state[p]["exp_avg"].data_ptr() for p in params} == homes
    for step in range(2, 4):
        step_both(ref, ref_params, opt, params, step)
    assert_bitwise(params, ref_params, "after assigned state")
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    for i, entry in ref_sd["state"].items():
        assert_bitwise([sd["state"][i]["exp_avg"], sd["state"][i]["exp_avg_sq"]],
                       [entry["exp_avg"], entry["exp_avg_sq"]], f"state_dict entry {i}")  # fmt: skip
    assert all(not opt.state[p]["exp_avg"].is_cuda for p in params if opt.is_offloaded(p))


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_whole_entry_assignment_and_deletion(fraction):
    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    for p, q in zip(params, ref_params, strict=True):
        opt.state[p] = copy.deepcopy(ref.state[q])  # a plain dict of new tensors, "step" a tensor
    del ref.state[ref_params[0]], opt.state[params[0]]  # reset: made again at the next grad
    step_both(ref, ref_params, opt, params, 1)
    assert_bitwise(params, ref_params, "after whole-entry assignment and a deletion")
    assert float(opt.state[params[0]]["step"]) == 1 and float(opt.state[params[2]]["step"]) == 2
    opt.state[params[2]]["step"] = 7  # a number into the counter
    assert float(opt.state_dict()["state"][2]["step"]) == 7


def test_a_wrong_shape_is_refused_naming_the_key():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    with pytest.raises(
        ValueError, match=r"opt.state\[...\]\['exp_avg'\] = a tensor of shape \(3,\)"
    ):
        opt.state[params[0]]["exp_avg"] = torch.zeros(3)


def test_copies_of_entries_are_plain_dicts():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    entry = copy.deepcopy(opt.state[params[0]])
    assert (
        type(entry) is dict
        and entry["exp_avg"].data_ptr() != opt.state[params[0]]["exp_avg"].data_ptr()
    )
