"""opt.state as frameworks use it: assigned entries land in the optimizer's own buffers (host
state stays on the host), deleted entries reset, and state_dict() reports what the update uses."""

import collections
import copy

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, groups_of, hybrid, make_params, seeded_grads

from offloadopt import HybridAdamW


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


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_an_interrupt_inside_step_arrives_after_the_step_is_whole(fraction, ctrl_c_raises):
    import os
    import signal

    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    if opt.debug.pipeline is not None:  # Ctrl-C while the worker updates the first bucket
        opt.debug.pipeline.worker_hook = lambda b: os.kill(os.getpid(), signal.SIGINT)
    else:
        ref_step = opt.debug.updater.device.run_rule

        def interrupted(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            return ref_step(*args, **kwargs)

        opt.debug.updater.device.run_rule = interrupted
    for p, q, g in zip(ref_params, params, seeded_grads(params, 1), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ref.step()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert_bitwise(params, ref_params, "every param stepped before the interrupt arrived")
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_load_state_dict_with_tensors_that_require_grad_loads():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    sd = copy.deepcopy(ref.state_dict())
    for entry in sd["state"].values():
        entry["exp_avg"].requires_grad_(True)
    opt.load_state_dict(sd)
    assert not opt.state[params[0]]["exp_avg"].requires_grad
    step_both(ref, ref_params, opt, params, 1)
    assert_bitwise(params, ref_params)


def test_param_names_of_a_named_checkpoint_survive_a_load_into_an_unnamed_optimizer():
    from offloadopt import HybridAdamW

    model = torch.nn.Linear(8, 8)
    named = HybridAdamW(model.named_parameters(), min_offload_numel=1)
    plain = HybridAdamW(model.parameters(), min_offload_numel=1)
    plain.load_state_dict(named.state_dict())
    assert plain.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


def test_non_param_keys_and_hook_added_keys_survive_state_dict():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    opt.state["global_counter"] = 3  # a non-param key, as some schedulers and wrappers keep

    def post_hook(optimizer, sd):
        sd["extra"] = {"epoch": 5}
        return sd

    opt.register_state_dict_post_hook(post_hook)
    sd = opt.state_dict()
    assert sd["state"]["global_counter"] == 3 and sd["extra"] == {"epoch": 5}


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_strided_view_param_is_updated_correctly_and_nothing_outside_it_is_written(fraction):
    from offloadopt import HybridAdamW

    base = torch.randn(64, 2)
    ref_base = base.clone()
    p, ref_p = torch.nn.Parameter(base[:, 0]), torch.nn.Parameter(ref_base[:, 0].contiguous())
    assert not p.is_contiguous()
    opt = HybridAdamW([p], offload_fraction=fraction, min_offload_numel=1)
    ref = torch.optim.AdamW([ref_p], fused=True)
    for step in range(3):
        g = torch.randn(64, generator=torch.Generator().manual_seed(step))
        p.grad, ref_p.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), ref_p.detach(), rtol=0, atol=0)
    torch.testing.assert_close(base[:, 1], ref_base[:, 1], rtol=0, atol=0)  # untouched


def test_code_that_calls_step_runs_under_torch_compile():
    from offloadopt import HybridAdamW

    model, ref_model = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    ref_model.load_state_dict(model.state_dict())
    opt = HybridAdamW(model.parameters(), min_offload_numel=1)
    ref = torch.optim.AdamW(ref_model.parameters(), fused=True)

    def train_step(m, o, x):
        m(x).pow(2).mean().backward()
        o.step()
        o.zero_grad()

    compiled = torch.compile(train_step, backend="aot_eager")
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        compiled(model, opt, x)
        train_step(ref_model, ref, x)
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()), "compiled")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_kept_state_dict_is_a_snapshot_for_every_entry(fraction):
    ref, ref_params, opt, params = pair(fraction)
    for step in range(2):
        step_both(ref, ref_params, opt, params, step)
    kept = opt.state_dict()
    frozen = copy.deepcopy(kept)
    live = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values()}
    for entry in kept["state"].values():
        for value in entry.values():
            assert value.device.type == "cpu"
            assert value.untyped_storage().data_ptr() not in live
    for step in range(2, 4):
        step_both(ref, ref_params, opt, params, step)
    for index, entry in frozen["state"].items():  # the later steps changed nothing kept
        for key, value in entry.items():
            assert torch.equal(kept["state"][index][key], value), (index, key)
    fresh = torch.optim.AdamW(groups_of(ref_params), fused=True)
    fresh.load_state_dict(kept)  # a snapshot loads like any state dict
    assert set(fresh.state_dict()["state"]) == set(kept["state"])


def meta_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_built_on_meta_then_to_empty_trains_as_torch_does(fraction, swap_on_conversion):
    torch.manual_seed(0)
    ref = meta_model()
    with torch.device("meta"):
        model = meta_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=fraction, min_offload_numel=16)
    assert opt.host_nbytes == 0  # nothing allocated for meta params
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    torch_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, o in ((ref, torch_opt), (model, opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert_bitwise(list(model.parameters()), list(ref.parameters()), "meta")
    expected = sum(p.numel() > 16 for p in model.parameters()) if fraction == 1.0 else None
    if expected is not None:
        assert sum(opt.is_offloaded(p) for p in model.parameters()) == expected


def test_a_param_still_on_meta_is_named_at_the_first_step():
    with torch.device("meta"):
        model = meta_model()
    opt = HybridAdamW(model.named_parameters(), min_offload_numel=16)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        model.to_empty(device="cpu")  # new param objects: the optimizer's stay on meta
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"0\.weight is still on the meta device"):
        opt.step()
    with pytest.raises(RuntimeError, match="meta device"):
        opt.state_dict()
    assert opt.host_nbytes == 0


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_number_assigned_over_a_state_tensor_is_refused_and_changes_nothing(fraction):
    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    before = opt.state[params[0]]["exp_avg"].clone()
    with pytest.raises(TypeError, match=r"\['exp_avg'\] = 3.0: the optimizer's buffer is a tensor"):
        opt.state[params[0]]["exp_avg"] = 3.0
    assert torch.equal(opt.state[params[0]]["exp_avg"], before)
    opt.state[params[0]]["step"] = 5  # a number into a one-element entry fills it
    assert float(opt.state[params[0]]["step"]) == 5.0


def test_a_kept_state_dict_keeps_a_tensor_lr():
    params = make_params()
    opt = HybridAdamW(params, lr=torch.tensor(1e-2), offload_fraction=0.5, min_offload_numel=64)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for p, g in zip(params, seeded_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    kept = opt.state_dict()
    lr = float(kept["param_groups"][0]["lr"])
    sched.step()
    assert float(kept["param_groups"][0]["lr"]) == lr != float(opt.param_groups[0]["lr"])


def test_the_placement_table_says_placement_is_pending_on_meta():
    with torch.device("meta"):
        model = meta_model()
    opt = HybridAdamW(model.parameters(), min_offload_numel=16)
    assert "placement pending: 4 params of 1 groups" in opt.placement_table()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_an_interrupt_inside_load_state_dict_arrives_after_every_entry_is_in(
    fraction, ctrl_c_raises
):
    """Found by a fresh user: Ctrl-C part-way through load_state_dict() left some params at
    the checkpoint's step and the others at the newer one, and the next step() went on."""
    import os
    import signal

    ref, ref_params, opt, params = pair(fraction)
    step_both(ref, ref_params, opt, params, 0)
    saved = copy.deepcopy(opt.state_dict())
    step_both(ref, ref_params, opt, params, 1)
    load_entry, seen = opt.debug.updater.load_entry, []

    def interrupted(p, rec, entry):
        seen.append(p)
        if len(seen) == 2:  # Ctrl-C between two entries
            os.kill(os.getpid(), signal.SIGINT)
        return load_entry(p, rec, entry)

    opt.debug.updater.load_entry = interrupted
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(saved)
    assert len(seen) == len(params) > 2
    assert {float(s["step"]) for s in opt.state.values()} == {
        1.0
    }  # every entry is the checkpoint's
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_load_state_dict_that_fails_part_way_leaves_the_optimizer_refusing():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    saved = copy.deepcopy(opt.state_dict())
    load_entry, seen = opt.debug.updater.load_entry, []

    def failing(p, rec, entry):
        seen.append(p)
        if len(seen) == 2:
            raise MemoryError("injected")
        return load_entry(p, rec, entry)

    opt.debug.updater.load_entry = failing
    with pytest.raises(MemoryError, match="injected"):
        opt.load_state_dict(saved)
    for p, g in zip(params, seeded_grads(params, 1), strict=True):
        p.grad = g
    with pytest.raises(RuntimeError, match="inconsistent: load_state_dict.. failed part-way"):
        opt.step()
    with pytest.raises(RuntimeError, match="inconsistent"):
        opt.state_dict()
    opt.debug.updater.load_entry = load_entry
    opt.load_state_dict(saved)  # a load that succeeds repairs it
    opt.step()


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_replacing_opt_state_starts_the_state_afresh_as_torch_does(fraction):
    """A fuzz's finding: ``opt.state = defaultdict(dict)`` between steps (torch accepts it: the
    state starts afresh) made the next step() raise AttributeError ('no attribute install').
    Now every param's state is made again at its next grad where it is placed, bitwise what
    torch does after the same assignment; a new mapping's entries are copied in."""
    ref, ref_params, opt, params = pair(fraction)
    where = [opt.is_offloaded(p) for p in params]
    for step in range(2):
        step_both(ref, ref_params, opt, params, step)
    ref.state = collections.defaultdict(dict)
    opt.state = collections.defaultdict(dict)
    assert len(opt.state) == 0 and [opt.is_offloaded(p) for p in params] == where
    for step in range(2, 5):
        step_both(ref, ref_params, opt, params, step)
    assert_bitwise(params, ref_params, "after opt.state was replaced")
    assert float(opt.state[params[0]]["step"]) == 3
    assert all(not opt.state[p]["exp_avg"].is_cuda for p in params if opt.is_offloaded(p))
    kept = {q: copy.deepcopy(ref.state[q]) for q in ref_params}
    ref.state = collections.defaultdict(dict, kept)
    opt.state = {p: copy.deepcopy(kept[q]) for p, q in zip(params, ref_params, strict=True)}
    step_both(ref, ref_params, opt, params, 5)
    assert_bitwise(params, ref_params, "after a non-empty mapping was assigned")


def test_a_replacement_state_that_does_not_fit_is_refused_and_changes_nothing():
    ref, ref_params, opt, params = pair(1.0)
    step_both(ref, ref_params, opt, params, 0)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="'exp_avg' has 3 elements"):
        opt.state = {params[0]: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}}
    with pytest.raises(TypeError, match="expected a mapping"):
        opt.state = 5
    after = opt.state_dict()
    for i, entry in before["state"].items():
        assert_bitwise(list(after["state"][i].values()), list(entry.values()), f"entry {i}")
