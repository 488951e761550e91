"""state_dict / load_state_dict: plain, portable, validated first, copied in, exact resume."""

import copy
import io
import warnings

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, groups_of, hybrid, make_params, seeded_grads

from offloadopt import HybridAdamW


def run(opt, params, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, seeded_grads(params, s), strict=True):
            p.grad = g
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def mixed_model():
    g = torch.Generator().manual_seed(7)
    return [
        torch.nn.Parameter(torch.randn(32, 16, generator=g).bfloat16()),
        torch.nn.Parameter(torch.randn(64, generator=g)),
    ]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c09_resume_is_bitwise_exact(fraction):
    ref_params = mixed_model()
    ref = HybridAdamW(ref_params, offload_fraction=fraction, min_offload_numel=1)
    run(ref, ref_params, 4)

    params = mixed_model()
    opt = HybridAdamW(params, offload_fraction=fraction, min_offload_numel=1)
    run(opt, params, 3)
    opt_sd, model_sd = roundtrip(opt.state_dict()), roundtrip([p.detach() for p in params])
    del opt
    fresh = mixed_model()  # a new process: fresh model and optimizer, then load both
    with torch.no_grad():
        for p, saved in zip(fresh, model_sd, strict=True):
            p.copy_(saved)
    opt = HybridAdamW(fresh, offload_fraction=fraction, min_offload_numel=1)
    opt.load_state_dict(opt_sd)
    run(opt, fresh, 1, start=3)
    assert_bitwise(fresh, ref_params)
    assert opt.state[fresh[0]]["step"].item() == 4 and opt.state[fresh[1]]["step"].item() == 4
    torch.testing.assert_close(
        fresh[0].detach(), opt.state[fresh[0]]["master"].bfloat16(), rtol=0, atol=0
    )
    assert "master" not in opt.state[fresh[1]]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_resume_across_a_change_of_fraction(fraction):
    ref_params = make_params(torch.bfloat16)
    ref = hybrid(ref_params, 1.0)
    run(ref, ref_params, 6)
    params = make_params(torch.bfloat16)
    opt = hybrid(params, 1.0 - fraction)
    run(opt, params, 3)
    sd = roundtrip(opt.state_dict())
    opt2 = hybrid(params, fraction)
    opt2.load_state_dict(sd)
    run(opt2, params, 3, start=3)
    assert_bitwise(params, ref_params)


def test_state_dict_is_plain_fp32_and_has_no_views():
    params = make_params(torch.bfloat16)
    opt = hybrid(params, 1.0)
    run(opt, params, 2)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        for k, t in entry.items():
            assert t.dtype == torch.float32, k
            if t.dim():
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k
    g = sd["param_groups"][0]
    assert g["fused"] is True and g["foreach"] is None and "offload" not in g
    # weights_only: no Python classes anywhere
    roundtrip(sd)


def test_c10_group_values_scheduler_and_own_keys_survive_a_load():
    params = make_params()
    opt = HybridAdamW(
        [{"params": params[:2], "lr": 0.125, "betas": (0.8, 0.9), "weight_decay": 0.3},
         {"params": params[2:], "offload": False}],
        min_offload_numel=1,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
    run(opt, params, 1)
    for _ in range(58):
        sched.step()
    opt_sd, sched_sd = roundtrip(opt.state_dict()), roundtrip(sched.state_dict())

    fresh = make_params()
    opt2 = HybridAdamW(
        [{"params": fresh[:2], "lr": 0.5, "betas": (0.5, 0.5), "weight_decay": 0.0},
         {"params": fresh[2:], "offload": False}],
        min_offload_numel=1,
    )  # fmt: skip
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1000)
    ptrs = [
        (a.master.data_ptr(), a.states["exp_avg"].data_ptr(), a.states["exp_avg_sq"].data_ptr())
        for a in opt2.arenas
    ]
    opt2.load_state_dict(opt_sd)
    sched2.load_state_dict(sched_sd)
    g = opt2.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"]) == (0.125, (0.8, 0.9), 0.3)
    assert sched2.last_epoch == 58 and g["initial_lr"] == 0.125
    assert [gr["offload"] for gr in opt2.param_groups] == [None, False]
    assert ptrs == [
        (a.master.data_ptr(), a.states["exp_avg"].data_ptr(), a.states["exp_avg_sq"].data_ptr())
        for a in opt2.arenas
    ]
    for p in fresh[:2]:
        home = opt2.debug.records[p].home("exp_avg")
        assert opt2.state[p]["exp_avg"].data_ptr() == home.data_ptr()


def _torch_then_hybrid(ref_params, params, fraction):
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    run(ref, ref_params, 10)
    torch_opt = torch.optim.AdamW(groups_of(params), fused=True)
    run(torch_opt, params, 5)
    opt = hybrid(params, fraction)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    run(opt, params, 5, start=5)
    assert_bitwise(params, ref_params, "torch -> hybrid")


def test_c14_cross_load_with_torch_adamw_both_ways():
    _torch_then_hybrid(make_params(), make_params(), 1.0)

    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(groups_of(ref_params), fused=True)
    run(ref, ref_params, 10)
    opt = hybrid(params, 1.0)
    run(opt, params, 5)
    torch_opt = torch.optim.AdamW(groups_of(params), fused=False, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(g["fused"] for g in torch_opt.param_groups)  # torch keeps its fused kernel
    run(torch_opt, params, 5, start=5)
    assert_bitwise(params, ref_params, "hybrid -> torch")

    ref_params, params = make_params(), make_params()
    ref = hybrid(ref_params, 1.0)
    run(ref, ref_params, 10)
    opt = hybrid(params, 1.0)
    run(opt, params, 5)
    opt2 = hybrid(params, 0.25)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(opt2, params, 5, start=5)
    assert_bitwise(params, ref_params, "hybrid 1.0 -> hybrid 0.25")


def test_load_does_not_alias_the_callers_tensors():
    params = make_params()
    opt = hybrid(params, 0.5)
    run(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = hybrid(params, 0.5)
    opt2.load_state_dict(sd)
    before = copy.deepcopy(opt2.state_dict())
    for entry in sd["state"].values():
        for t in entry.values():
            t.add_(1.0)
    after = opt2.state_dict()
    for k, entry in before["state"].items():
        for name, t in entry.items():
            torch.testing.assert_close(after["state"][k][name], t, rtol=0, atol=0)


def test_bf16_from_torch_adamw_warns_that_it_cannot_be_exact():
    params = make_params(torch.bfloat16)
    torch_opt = torch.optim.AdamW(groups_of(params), fused=True)
    run(torch_opt, params, 2)
    opt = hybrid(params, 1.0)
    with pytest.warns(UserWarning, match="not bitwise exact"):
        opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    run(opt, params, 1, start=2)


def _bad_dicts(sd):
    def edit(f):
        d = copy.deepcopy(sd)
        f(d)
        return d

    first = next(iter(sd["state"]))
    yield "has 2 parameter groups, the optimizer 3", edit(lambda d: d["param_groups"].pop())
    yield "has 1 params", edit(lambda d: d["param_groups"][0].__setitem__("params", [0]))
    yield (
        "'exp_avg' has shape",
        edit(lambda d: d["state"][first].__setitem__("exp_avg", torch.zeros(3))),
    )
    yield "lacks 'exp_avg_sq'", edit(lambda d: d["state"][first].pop("exp_avg_sq"))
    yield (
        "keys \\['max_exp_avg_sq'\\]",
        edit(lambda d: d["state"][first].__setitem__("max_exp_avg_sq", torch.zeros(1))),
    )
    yield "Invalid learning rate: -1", edit(lambda d: d["param_groups"][2].__setitem__("lr", -1.0))
    yield "amsgrad=True", edit(lambda d: d["param_groups"][1].__setitem__("amsgrad", True))
    yield (
        "invalid 'step'",
        edit(lambda d: d["state"][first].__setitem__("step", torch.tensor(float("nan")))),
    )
    yield "in no saved param group", edit(lambda d: d["state"].__setitem__(99, d["state"][first]))
    yield "'state' and 'param_groups'", {"state": {}}
    # another optimizer's: torch.optim.SGD's groups (lr 5.0, momentum, no betas or eps) were
    # taken, the moments dropped, and the next step moved every weight by 5 (a new user's find)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5.0, momentum=0.9)
    sgd_keys = {k: v for k, v in sgd.state_dict()["param_groups"][0].items() if k != "params"}

    def as_sgd(d):
        d["param_groups"] = [{"params": g["params"], **sgd_keys} for g in d["param_groups"]]

    yield "group 0 has no 'betas', 'eps': not a state dict of HybridAdamW", edit(as_sgd)


def test_a_bad_state_dict_raises_and_leaves_the_optimizer_unchanged():
    params = make_params(torch.bfloat16)
    opt = hybrid(params, 0.5)
    run(opt, params, 2)
    good = copy.deepcopy(opt.state_dict())
    run(opt, params, 1, start=2)
    expected = copy.deepcopy(opt.state_dict())
    for match, bad in _bad_dicts(good):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        now = opt.state_dict()
        assert now["param_groups"] == expected["param_groups"], match
        for k, entry in expected["state"].items():
            for name, t in entry.items():
                torch.testing.assert_close(now["state"][k][name], t, rtol=0, atol=0, msg=match)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_empty_state_entries_from_defaultdict_lookups_load(fraction):
    # A second user: `"exp_avg" in opt.state[p]` (logging code) leaves {} in the defaultdict;
    # torch saves and loads such entries, so must we.
    params = make_params()
    opt = hybrid(params, fraction)
    assert "exp_avg" not in opt.state[params[0]]
    opt.load_state_dict(roundtrip(opt.state_dict()))
    run(opt, params, 2)
    _ = opt.state[
        torch.nn.Parameter(torch.zeros(1))
    ]  # a foreign key: not ours, ignored by torch too
    torch_opt = torch.optim.AdamW(groups_of(make_params()), fused=True)
    _ = torch_opt.state[torch_opt.param_groups[0]["params"][0]]
    hybrid(make_params(), fraction).load_state_dict(copy.deepcopy(torch_opt.state_dict()))


def test_step_of_any_one_element_shape_loads_and_meta_tensors_are_refused_untouched():
    params = make_params()
    opt = hybrid(params, 1.0)
    run(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = entry["step"].reshape(1)  # (1,) instead of ()
    opt.load_state_dict(sd)
    assert all(
        opt.state[p]["step"].shape == () and opt.state[p]["step"].item() == 2 for p in params
    )
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][max(bad["state"])]["exp_avg"] = torch.empty(params[-1].shape, device="meta")
    with pytest.raises(ValueError, match="meta"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, entry in before["state"].items():
        for name, t in entry.items():
            torch.testing.assert_close(after["state"][k][name], t, rtol=0, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("trained_first", [False, True])
def test_a_model_cast_after_the_optimizer_was_built_then_loaded_resumes_bitwise(fraction,
                                                                               trained_first):  # fmt: skip
    """Build the optimizer, cast the model to bf16, load a bf16 run's checkpoint, step: the
    load places the params again in bf16 (state made before the cast, in fp32, is replaced
    by the checkpoint's) and the run goes on bitwise, without a warning."""
    ref_params = make_params(torch.bfloat16)
    ref = hybrid(ref_params, fraction)
    run(ref, ref_params, 3)
    opt_sd, model_sd = roundtrip(ref.state_dict()), roundtrip([p.detach() for p in ref_params])
    run(ref, ref_params, 2, start=3)

    model = torch.nn.ParameterList(make_params())
    opt = hybrid(list(model), fraction)
    if trained_first:
        run(opt, list(model), 1)
    model.to(torch.bfloat16)
    with torch.no_grad():
        for p, saved in zip(model, model_sd, strict=True):
            p.copy_(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(opt_sd)
        run(opt, list(model), 2, start=3)
    assert_bitwise(list(model), ref_params)
    assert all(opt.state[p]["master"].dtype == torch.float32 for p in model)
