"""The torch.optim contract and argument validation."""

import copy
import io
import math
import re
import warnings

import pytest
import torch
from oracle import FRACTIONS, assert_bitwise, hybrid, make_params, seeded_grads

import offloadopt.link.host as host
from offloadopt import HybridAdamW, PinnedAllocationError


def w(n=128):
    return torch.nn.Parameter(torch.randn(n))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(offload_fraction=-0.1), "offload_fraction: -0.1"),
        (dict(offload_fraction=1.5), "offload_fraction: 1.5"),
        (dict(offload_fraction=math.nan), "offload_fraction: nan"),
        (dict(offload_fraction="0.5"), "offload_fraction: '0.5'"),
        (dict(lr=-1e-3), "learning rate: -0.001"),
        (dict(eps=-1.0), "epsilon value: -1.0"),
        (dict(betas=(1.0, 0.999)), "beta parameter at index 0: 1.0"),
        (dict(betas=(0.9, -0.1)), "beta parameter at index 1: -0.1"),
        (dict(weight_decay=-0.1), "weight_decay value: -0.1"),
        (dict(min_offload_numel=-1), "min_offload_numel: -1"),
        (dict(bucket_nbytes=0), "bucket_nbytes: 0"),
    ],
)
def test_invalid_arguments_raise_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        HybridAdamW([w()], **kwargs)


def test_bad_param_lists():
    with pytest.raises(ValueError, match="empty parameter list"):
        HybridAdamW([])
    with pytest.raises(TypeError, match="iterable of Tensors"):
        HybridAdamW(w())
    p = w()
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's warning, kept once
        HybridAdamW([p, p])  # (tests/test_torch_errors.py)
    with pytest.raises(ValueError, match="more than one parameter group"):
        HybridAdamW([{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError, match="complex parameters are not supported: z"):
        HybridAdamW([("z", torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64)))])
    with pytest.raises(ValueError, match="master_weights: 'yes'"):  # as every bad value
        HybridAdamW([p], master_weights="yes")
    for flag in ("pin_memory", "flush_denormal", "grads_final", "release_grads", "speculate"):
        with pytest.raises(ValueError, match=f"Invalid {flag}: 'yes' \\(expected a bool\\)"):
            HybridAdamW([p], **{flag: "yes"})
    with pytest.raises(ValueError, match="'offload' group key: 'yes'"):
        HybridAdamW([{"params": [p], "offload": "yes"}])
    for flag in ("amsgrad", "capturable", "differentiable"):
        with pytest.raises(NotImplementedError, match=flag):
            HybridAdamW([p], **{flag: True})


def test_a_frozen_integer_param_is_refused_with_the_way_around():
    # A user's find: torch's optimizers keep a frozen int64 Parameter (it never gets a grad);
    # ours refuse it, and the message now says how to leave it out
    frozen = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=r"torch.int64: only floating-point .*leave it out: "
                                         r"\[p for p in model.parameters\(\) if p.is_floating_point\(\)\]"):  # fmt: skip
        HybridAdamW([w(), frozen])


def test_an_option_as_a_group_key_is_refused_unless_it_is_the_optimizers():
    # A user's find: an option in a group dict (min_offload_numel, overlap, ...) was ignored.
    p, q = w(), w()
    for key, value in (("overlap", "backward"), ("min_offload_numel", 1), ("offload_fraction", 0.5),
                       ("bucket_nbytes", 4096), ("pin_memory", False), ("state_dtype", "int8")):  # fmt: skip
        with pytest.raises(ValueError, match=f"param group 1 has {key}={value!r} .*not per group"):
            HybridAdamW([{"params": [p]}, {"params": [q], key: value}])
    opt = HybridAdamW([p], min_offload_numel=1)
    with pytest.raises(ValueError, match="param group 1 has grads_final=True"):
        opt.add_param_group({"params": [q], "grads_final": True})
    assert len(opt.param_groups) == 1
    # torch's ZeroRedundancyOptimizer copies the constructor's keywords into each group: the
    # optimizer's own values pass; torch's keys stay per group, and other keys are kept
    opt = HybridAdamW([{"params": [p], "offload_fraction": 0.5, "min_offload_numel": 1, "lr": 0.5,
                        "betas": (0.5, 0.6), "weight_decay": 0.1, "eps": 1e-3, "name": "head"},
                       {"params": [q]}], offload_fraction=0.5, min_offload_numel=1)  # fmt: skip
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["eps"], g["name"]) == (
        0.5, (0.5, 0.6), 0.1, 1e-3, "head")  # fmt: skip
    assert opt.param_groups[1]["lr"] == 1e-3


def test_a_loaded_group_keeps_the_loading_optimizers_options_not_the_saved_ones():
    # A user's find: a checkpoint of groups carrying options (min_offload_numel, overlap)
    # loaded into an optimizer built with other values, and its groups then carried values
    # it did not run with; the refusal named the constructor's fraction as the optimizer's.
    p = w()
    src = HybridAdamW([{"params": [p], "overlap": "step", "min_offload_numel": 1}],
                      min_offload_numel=1)  # fmt: skip
    p.grad = torch.ones_like(p)
    src.step()
    sd = src.state_dict()
    assert sd["param_groups"][0]["overlap"] == "step"
    dst = HybridAdamW([p], overlap="step", min_offload_numel=8, lr=0.5)
    dst.load_state_dict(sd)
    g = dst.param_groups[0]
    assert "min_offload_numel" not in g and "overlap" not in g  # the saved ones not taken
    assert g["lr"] == 1e-3  # the saved hyperparameters are taken, as torch's
    zero = HybridAdamW([{"params": [p], "min_offload_numel": 8}], min_offload_numel=8)
    zero.load_state_dict(sd)
    assert zero.param_groups[0]["min_offload_numel"] == 8  # its own key kept
    opt = HybridAdamW([w()], offload_fraction=1.0, min_offload_numel=1)
    with pytest.raises(ValueError, match=r"offload_fraction=0.5 \(the constructor's: 1.0\)"):
        opt.add_param_group({"params": [w()], "offload_fraction": 0.5})


def test_one_word_swap_flags_are_accepted():
    opt = HybridAdamW([w()], lr=1e-3, fused=True, foreach=False, min_offload_numel=1)
    g = opt.param_groups[0]
    assert (g["fused"], g["foreach"], g["capturable"], g["differentiable"]) == (
        True,
        None,
        False,
        False,
    )
    assert isinstance(opt, torch.optim.Optimizer)


def test_tensor_lr_matches_torch():
    p, q = w(), w()
    q.data.copy_(p.data)
    ref = torch.optim.AdamW([p], lr=torch.tensor(0.01), fused=True)
    opt = HybridAdamW([q], lr=torch.tensor(0.01), min_offload_numel=1)
    for s in range(3):
        p.grad = q.grad = seeded_grads([p], s)[0]
        ref.step()
        opt.step()
    torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_grad_none_is_skipped_and_no_stale_grad_is_reused(fraction):
    params = make_params()
    opt = hybrid(params, fraction)
    for p, g in zip(params, seeded_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].item() for p in params]
    opt.zero_grad(set_to_none=True)
    params[0].grad = torch.zeros_like(params[0])  # a zero grad is not a skip
    opt.step()
    assert opt.state[params[0]]["step"].item() == 2
    assert not torch.equal(params[0], before[0])  # momentum still moves it
    for p, b, s in zip(params[1:], before[1:], steps[1:], strict=True):
        torch.testing.assert_close(
            p, b, rtol=0, atol=0
        )  # untouched: last step's host grad not reused
        assert opt.state[p]["step"].item() == s


def test_zero_grad_keeps_or_drops_grads():
    p = w()
    opt = HybridAdamW([p], min_offload_numel=1)
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and p.grad.abs().sum() == 0
    opt.zero_grad()
    assert p.grad is None


def test_closure_runs_with_grad_and_returns_loss():
    p = w()
    opt = HybridAdamW([p], min_offload_numel=1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.state[p]["step"].item() == 1


def test_state_is_lazy_and_unfreezing_later_works():
    a, b = w(), w()
    b.requires_grad_(False)
    opt = HybridAdamW([a, b], min_offload_numel=1)
    assert len(opt.state) == 0
    assert [pl.reason for pl in opt.placement] == ["fraction", "frozen"]
    b.requires_grad_(True)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert opt.state[b]["step"].item() == 1 and not opt.is_offloaded(b)


def test_step_hooks_run():
    p = w()
    opt = HybridAdamW([p], min_offload_numel=1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    p.grad = torch.ones_like(p)
    opt.step()
    assert calls == ["pre", "post"]


def test_weights_changed_outside_refresh_the_master_with_a_warning():
    p = torch.nn.Parameter(torch.randn(256).bfloat16())
    opt = HybridAdamW([p], min_offload_numel=1)
    p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        p.fill_(2.0)  # a checkpoint loaded into the model, an EMA swap, ...
    with pytest.warns(UserWarning, match="changed outside the optimizer") as caught:
        opt.step()
    # It names the line that called step(), not one inside torch's no_grad wrapper.
    assert [w.filename for w in caught] == [__file__]
    # The update started from 2.0, not from the stale master.
    assert (p.float() - 2.0).abs().max() < 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # our own writes are not mistaken for outside edits


@pytest.mark.parametrize(  # fp32 on the device has no master: nothing to refresh
    "dtype, fraction", [(torch.bfloat16, 0.0), (torch.bfloat16, 1.0), (torch.float32, 1.0)]
)
def test_nan_payloads_are_kept_bit_for_bit_when_a_master_is_refreshed(dtype, fraction):
    """A fuzz's finding: a NaN weight always compared unequal to its master, so every refresh
    (an edit anywhere in the tensor) replaced the master's NaN bits with the rounded weight's,
    and a NaN weight warned at every step. Now an edited element's new bits reach the master
    exactly (bf16 -> fp32 is exact), an element not edited keeps the master's bits, and a
    NaN weight is not mistaken for an edit. lr=0 and weight_decay=0: the update keeps NaNs'
    payloads, so the master's bits show what the refresh did."""
    p = torch.nn.Parameter(torch.randn(4096).to(dtype))
    opt = HybridAdamW([p], lr=0.0, weight_decay=0.0, min_offload_numel=1, offload_fraction=fraction)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    nan = {torch.bfloat16: 0x7FC5, torch.float32: 0x7FC00123}[dtype]  # a quiet NaN, a payload
    p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        p.view(bits)[0] = nan  # an edit to a NaN with a payload
    with pytest.warns(UserWarning, match=r"\(1 of 4096 elements\)"):
        opt.step()
    if dtype == torch.float32:  # offloaded fp32: the master is the arena's copy, same bits
        master = opt.debug.records[p].home("master")  # (4096,) fp32, host arena
    else:
        master, nan = opt.state[p]["master"], nan << 16  # bf16 -> fp32 is exact: payload kept
    assert int(master.view(torch.int32)[0]) & 0xFFFFFFFF == nan
    with torch.no_grad():
        p[1] = 3.0  # an edit elsewhere: element 0's master keeps its bits
    with pytest.warns(UserWarning, match=r"\(1 of 4096 elements\)"):
        opt.step()
    assert int(master.view(torch.int32)[0]) & 0xFFFFFFFF == nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # a NaN weight over a NaN master is not an edit


def test_pinned_allocation_failure_says_how_many_bytes(monkeypatch):
    class Cudart:  # a patched allocator: cudaHostRegister fails as on an exhausted host
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    with pytest.raises(
        PinnedAllocationError, match="could not pin 4000 bytes .* for the test buffer"
    ):
        host.alloc_host(1000, torch.float32, True, "the test buffer")

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(
        PinnedAllocationError, match="could not allocate 8000 bytes .* pinned host memory"
    ):
        host.alloc_host(1000, torch.float64, True, "the test buffer")


def test_sparse_grads_raise_naming_the_param():
    emb = torch.nn.Embedding(100, 64, sparse=True)
    opt = HybridAdamW(emb.named_parameters(), min_offload_numel=1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients: weight"):
        opt.step()


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_param_without_grad_sharing_a_bucket_with_one_that_has_one(fraction):
    # An unused submodule: its params never get a grad, so never get state; they share the
    # bucket of the used ones (found by a fresh user: KeyError 'step').
    m = torch.nn.ModuleDict(
        {"used": torch.nn.Linear(128, 128), "unused": torch.nn.Linear(128, 128)}
    )
    ref_m = torch.nn.ModuleDict({"used": torch.nn.Linear(128, 128)})
    ref_m.load_state_dict({k: v for k, v in m.state_dict().items() if k.startswith("used")})
    opt = HybridAdamW(m.parameters(), offload_fraction=fraction)
    ref = torch.optim.AdamW(ref_m.parameters(), fused=True)
    x = torch.randn(2, 128)
    for _ in range(2):
        for model, o in ((m, opt), (ref_m, ref)):
            model["used"](x).sum().backward()
            o.step()
            o.zero_grad()
    assert not any(p in opt.state for p in m["unused"].parameters())
    torch.testing.assert_close(m["used"].weight, ref_m["used"].weight, rtol=0, atol=0)


def test_non_contiguous_params_stay_on_the_device_with_a_warning():
    conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    with pytest.warns(UserWarning, match="not contiguous.*weight"):
        opt = HybridAdamW(conv.named_parameters(), min_offload_numel=1)
    assert not opt.is_offloaded(conv.weight) and opt.is_offloaded(conv.bias)
    conv(torch.randn(1, 8, 5, 5).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()


def test_pickling_is_refused_clearly():
    import copy

    opt = HybridAdamW([w()], min_offload_numel=1)
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied") as info:
        copy.deepcopy(opt)
    assert "torch.save" not in str(info.value)


def test_a_refused_torch_save_names_the_file_it_emptied(tmp_path):
    # A user's find: torch.save({"opt": opt}, path) over a checkpoint left an empty file and
    # said nothing of it (torch.save opens the file before it pickles)
    opt = HybridAdamW([w()], min_offload_numel=1)
    path = tmp_path / "ck.pt"
    torch.save({"x": torch.zeros(3)}, path)
    with pytest.raises(
        TypeError, match=re.escape(f"torch.save had opened {str(path)!r} before this")
    ):
        torch.save({"opt": opt}, path)
    with pytest.raises(TypeError) as info:
        torch.save({"opt": opt}, io.BytesIO())  # no file to name
    assert "torch.save" not in str(info.value)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_partial_outside_edit_refreshes_only_the_changed_elements(fraction):
    # A second user: re-initialising one embedding row must not round the fp32 master of the
    # other rows to bf16.
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(64, 64, generator=gen).bfloat16()
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.float())
    opt = HybridAdamW([p], lr=1e-2, offload_fraction=fraction, min_offload_numel=1)
    ref = torch.optim.AdamW([q], lr=1e-2, fused=True)

    def step():
        g = torch.randn(64, 64, generator=gen).bfloat16()
        p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()

    step()
    step()
    with torch.no_grad():
        p[0].fill_(0.25)
        q[0].fill_(0.25)
    with pytest.warns(UserWarning, match="64 of 4096 elements"):
        step()
    step()
    torch.testing.assert_close(p.detach(), q.detach().bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(opt.state[p]["master"], q.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_with_other_strides_give_the_same_update_at_every_fraction(fraction, dtype):
    # A second user: a transposed grad set by hand. torch's fused kernel walks memory flat and
    # ignores the grad's strides; HybridAdamW matches the grad to the param first, everywhere.
    gen = torch.Generator().manual_seed(6)
    w0 = torch.randn(96, 80, generator=gen).to(dtype)
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.float())
    opt = HybridAdamW([p], lr=1e-2, offload_fraction=fraction, min_offload_numel=1)
    ref = torch.optim.AdamW([q], lr=1e-2, fused=True)
    for _ in range(3):
        g = torch.randn(80, 96, generator=gen).to(dtype).t()  # (96, 80), not contiguous
        p.grad, q.grad = g, g.float().contiguous()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach().to(dtype), rtol=0, atol=0)


def test_masters_loaded_into_an_optimizer_without_masters_warn_accurately():
    params = make_params(torch.bfloat16)
    opt = hybrid(params, 1.0)
    for p, g in zip(params, seeded_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    with pytest.warns(UserWarning, match="master_weights=False"):
        hybrid(params, 1.0, master_weights=False).load_state_dict(sd)


def test_the_options_are_declared_once_and_documented():
    """The offloading options live in one frozen dataclass (offloadopt/options.py); the
    TypedDict that IDEs read for ``**options`` lists the same names, and HybridAdamW's
    docstring documents each one."""
    import dataclasses
    import typing

    from offloadopt.options import OffloadOptions, Options

    fields = {f.name for f in dataclasses.fields(Options)}
    assert set(typing.get_type_hints(OffloadOptions, include_extras=False)) == fields - {
        "placement_policy"  # HybridDeviceOptimizer's, set by its constructor
    }
    doc = HybridAdamW.__doc__
    undocumented = [n for n in fields - {"placement_policy"} if f"{n}:" not in doc]
    assert not undocumented, undocumented
    opt = HybridAdamW([w()], overlap="backward", grads_final=True, min_offload_numel=1)
    assert opt.options == Options(overlap="backward", grads_final=True, min_offload_numel=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.options.overlap = "step"


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_flag_that_changes_the_algorithm_set_on_a_live_group_is_refused_at_step(fraction):
    # A user's find: torch's AdamW reads amsgrad and decoupled_weight_decay at every step
    # (amsgrad=True changes the update, decoupled_weight_decay=False makes it Adam's); set on
    # a live group they were ignored and step() ran plain AdamW, with no error.
    p = w()
    opt = HybridAdamW([p], weight_decay=0.5, offload_fraction=fraction, min_offload_numel=1)
    p.grad = torch.ones_like(p)
    opt.step()
    before = [p.clone(), *(v.clone() for v in opt.state[p].values())]
    for key, value, error, match in (
        ("amsgrad", True, NotImplementedError, "param group 0: HybridAdamW does not support amsgrad=True"),
        ("decoupled_weight_decay", False, ValueError, "param group 0: decoupled_weight_decay=False: .*use offloadopt.HybridAdam$"),
    ):  # fmt: skip
        opt.param_groups[0][key] = value
        with pytest.raises(error, match=match):
            opt.step()
        after = [p, *opt.state[p].values()]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))  # unchanged
        opt.param_groups[0][key] = not value  # set back: steps again
    opt.step()
    assert int(opt.state[p]["step"]) == 2
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):  # and when built so
        HybridAdamW([{"params": [w()], "decoupled_weight_decay": False}])


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_cast_after_the_optimizer_was_built_follows_the_cast_or_is_refused(fraction, dtype):
    # model.double() or .to(torch.bfloat16) after HybridAdamW(...): an offloaded param kept
    # the dtype it was placed with (an fp64 param got fp32 moments and an fp32 "master",
    # updated in fp32, silently), and once state existed fraction 0 failed in torch's kernel
    # naming no param while fraction 1 went on in fp32.
    def run(opt, params, steps, start=0):
        for s in range(start, start + steps):
            for p, g in zip(params, seeded_grads(params, s), strict=True):
                p.grad = g
            opt.step()

    # No state yet: placed again in the new dtype at step(), bitwise an optimizer built after
    # the cast (torch's AdamW makes its state at the first step, in the param's dtype).
    model, ref = torch.nn.ParameterList(make_params()), make_params(dtype)
    opt, ref_opt = hybrid(list(model), fraction), hybrid(ref, fraction)
    model.to(dtype)
    run(opt, list(model), 3)
    run(ref_opt, ref, 3)
    for p, q in zip(model, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
        assert {k: v.dtype for k, v in opt.state[p].items()} == {
            k: v.dtype for k, v in ref_opt.state[q].items()
        }
    # State made in fp32: step() refuses, naming the param and both dtypes, before any change.
    model = torch.nn.ParameterList(make_params())
    opt = hybrid(list(model), fraction)
    run(opt, list(model), 1)
    model.to(dtype)
    for p, g in zip(model, seeded_grads(list(model), 1), strict=True):
        p.grad = g
    before = [t.clone() for p in model for t in (p, *opt.state[p].values())]
    match = rf"param group 0, param 0 \(group0\.param0\): placed as torch\.float32 and now {dtype}.*Cast the model back to torch\.float32, or build the optimizer after casting"
    with pytest.raises(ValueError, match=match):
        opt.step()
    after = [t for p in model for t in (p, *opt.state[p].values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))  # unchanged
    model.float()  # cast back: steps again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the weights are new tensors: masters refreshed
        opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_set_offload_fraction_after_a_cast_with_state_is_refused(dtype):
    # set_offload_fraction() copies the state into buffers placed for the params' dtypes now:
    # after a cast it moved fp32 state into fp64 (or made a bf16 param's master from its
    # weights) with no error, where step() refuses the cast.
    model = torch.nn.ParameterList(make_params())
    opt = hybrid(list(model), 0.5)
    for p, g in zip(model, seeded_grads(list(model), 0), strict=True):
        p.grad = g
    opt.step()
    model.to(dtype)
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model]
    with pytest.raises(
        ValueError,
        match=rf"param group 0, param 0 \(group0\.param0\): placed as torch\.float32 and now {dtype}",
    ):
        opt.set_offload_fraction(1.0)
    for p, before in zip(model, state, strict=True):  # nothing moved or cast
        assert {k: (v.dtype, v.device) for k, v in opt.state[p].items()} == {
            k: (v.dtype, v.device) for k, v in before.items()
        }
        assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    assert opt.offload_fraction == 0.5


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_cast_param_without_state_is_placed_again_while_others_have_state(fraction, dtype):
    # A param whose grad was None at the first steps has no state; cast then (its layer moved
    # to another dtype) and given a grad, step() refused it because OTHER params had state,
    # where torch's AdamW makes its state at its first step, in its dtype.
    late = (4, 5)  # group 2's first two params: no grad until the cast

    def run(opt, params, steps, start=0):
        for s in range(start, start + steps):
            for k, (p, g) in enumerate(zip(params, seeded_grads(params, s), strict=True)):
                p.grad = None if s < 2 and k in late else g
            opt.step()

    params, ref = make_params(), make_params()
    torch.nn.ParameterList([ref[k] for k in late]).to(dtype)  # the reference: built after
    opt, ref_opt = hybrid(params, fraction), hybrid(ref, fraction)
    run(opt, params, 2)
    assert all(not opt.state.get(params[k]) for k in late) and opt.state[params[0]]
    torch.nn.ParameterList([params[k] for k in late]).to(dtype)
    run(opt, params, 2, start=2)
    run(ref_opt, ref, 4)
    assert_bitwise(params, ref, "late cast")
    for p, q in zip(params, ref, strict=True):
        assert p.dtype == q.dtype
        assert {k: v.dtype for k, v in opt.state[p].items()} == {
            k: v.dtype for k, v in ref_opt.state[q].items()
        }
    assert [pl.dtype for pl in opt.placement] == [pl.dtype for pl in ref_opt.placement]

    # A cast param WITH state is refused, named (not the stateless one cast beside it, listed
    # first), before anything changes: the stateless one is not placed again either.
    params = make_params()
    opt = hybrid(params, fraction)
    run(opt, params, 2)
    torch.nn.ParameterList([params[4], params[6]]).to(dtype)  # 4 has no state, 6 has
    for p, g in zip(params, seeded_grads(params, 2), strict=True):
        p.grad = g
    placed = list(opt.placement)
    before = [t.clone() for p in params for t in (p, *opt.state[p].values())]
    match = rf"param group 2, param 2 \(group2\.param2\): placed as torch\.float32 and now {dtype}"
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert opt.placement == placed and not opt.state.get(params[4])
    after = [t for p in params for t in (p, *opt.state[p].values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))  # unchanged
    torch.nn.ParameterList([params[6]]).float()  # the param with state cast back: steps again
    opt.step()
    assert int(opt.state[params[6]]["step"]) == 3 and int(opt.state[params[4]]["step"]) == 1
    assert opt.placement[4].dtype == dtype and opt.placement[6].dtype == torch.float32


def _budget_params(dtype=torch.float32):
    # 8 equal params of 4096 elements: the fraction the budget chooses is a whole number of them
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4096, generator=g).to(dtype)) for _ in range(8)]


def _budgeted(params, budget):
    return HybridAdamW(params, lr=1e-2, min_offload_numel=1, bucket_nbytes=4096,
                       max_gpu_memory=budget, activation_bytes=0)  # fmt: skip


def test_a_cast_before_the_first_step_chooses_the_budgets_fraction_again():
    # max_gpu_memory chose its fraction for fp32 params (placed: ensure_placed(), or a step()
    # without grads); model.double() then doubled the state bytes and the params were placed
    # again at the fp32 fraction, over the budget, unchecked. The budget chooses again now,
    # as at the first step(): bitwise the optimizer built with the budget after the cast.
    n = 8 * 4096
    budget = 24 * n + 4 * 4096  # fp32: all state fits on the device; fp64: half of it
    model = torch.nn.ParameterList(_budget_params())
    opt = _budgeted(list(model), budget)
    opt.ensure_placed()
    assert opt.offload_fraction == 0.0
    model.double()
    ref = _budget_params(torch.float64)
    ref_opt = _budgeted(ref, budget)
    for s in range(3):
        for ps, o in ((list(model), opt), (ref, ref_opt)):
            for p, g in zip(ps, seeded_grads(ps, s), strict=True):
                p.grad = g
            o.step()
    assert opt.offload_fraction == ref_opt.offload_fraction > 0
    assert opt.placement == ref_opt.placement
    assert opt.placement_choice["predicted_gpu_bytes"] == ref_opt.placement_choice["predicted_gpu_bytes"] <= budget  # fmt: skip
    assert_bitwise(list(model), ref, "cast under a budget")
    assert all(v.dtype == torch.float64 for p in model for v in opt.state[p].values() if v.dim())
    assert "torch.float32 -> torch.float64" in opt.placement_choice["chosen_again"]
    # load_state_dict() after the cast places again too: at the budget's fraction for fp64.
    loaded = torch.nn.ParameterList(_budget_params())
    opt = _budgeted(list(loaded), budget)
    opt.ensure_placed()
    loaded.double()
    with torch.no_grad():
        for p, q in zip(loaded, ref, strict=True):
            p.copy_(q)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.offload_fraction == ref_opt.offload_fraction and opt.placement == ref_opt.placement
    for ps, o in ((list(loaded), opt), (ref, ref_opt)):
        for p, g in zip(ps, seeded_grads(ps, 3), strict=True):
            p.grad = g
        o.step()
    assert_bitwise(list(loaded), ref, "loaded after a cast under a budget")

    # A budget no fraction meets in the new dtype: refused as at the first step(), with the
    # figures, before anything changes; cast back, the step runs at the budget's fraction.
    budget = 16 * n + 4096  # fp32 fits with every state on the device; fp64's weights do not
    model = torch.nn.ParameterList(_budget_params())
    opt = _budgeted(list(model), budget)
    opt.ensure_placed()
    placed, choice = list(opt.placement), dict(opt.placement_choice)
    model.double()
    for p, g in zip(model, seeded_grads(list(model), 0), strict=True):
        p.grad = g
    with pytest.raises(ValueError, match=r"max_gpu_memory=.* cannot be met: the fewest device bytes, at offload fraction [0-9.]+, are .*cast"):  # fmt: skip
        opt.step()
    assert opt.placement == placed and opt.placement_choice == choice and not opt.state
    model.float()
    opt.step()
    assert opt.offload_fraction == choice["fraction"] and int(opt.state[model[0]]["step"]) == 1
    # The same cast met by load_state_dict(): a ValueError before anything is copied in (it
    # was a RuntimeError "failed part-way" that left the optimizer refusing step()).
    sd = opt.state_dict()
    model.double()
    with pytest.raises(ValueError, match=r"max_gpu_memory=.* cannot be met.*cast"):
        opt.load_state_dict(sd)
    assert opt.placement == placed and int(opt.state[model[0]]["step"]) == 1
    model.float()
    opt.step()
    assert int(opt.state[model[0]]["step"]) == 2
