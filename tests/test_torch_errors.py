"""torch's contract for bad arguments: the error cases of torch's generic optimizer tests
(``test_errors`` in torch's test/optim, over ``optim_db``'s ``optim_error_inputs_func``) run
over HybridAdamW, HybridAdam and HybridSGD with every param offloaded (``offload_fraction=1``,
``min_offload_numel=1``). Each case raises torch's exception type, or warns torch's warning
category, with a message torch's pattern finds, before anything is built: an input torch gives
as ``params=None`` must fail on its hyperparameters alone, as torch's constructors do.

The cases are read from the installed torch, so a torch release that adds one is tested at
once; one departure is kept on purpose (``DEPARTURES``). The cases after them are this
project's own, so the contract holds where torch's list changes.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from offloadopt import HybridAdam, HybridAdamW, HybridSGD

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")

from torch_db import import_optim_db  # noqa: E402

MIRRORS = {torch.optim.AdamW: HybridAdamW, torch.optim.Adam: HybridAdam, torch.optim.SGD: HybridSGD}
OFFLOADED = dict(offload_fraction=1.0, min_offload_numel=1)  # every param's state on the host
# torch 2.15 accepts a set of params with a FutureWarning ("This will be an error in a future
# release"); the hybrids refuse it now (TypeError, torch's words): the order of the params
# decides which are offloaded and the checkpoint's layout, and a set's order changes between
# runs, so a run could not resume from its own checkpoint.
DEPARTURES = {"warn on a bare unordered set of params": (TypeError, "ordered collections")}


def _cases() -> list:
    optim_db = import_optim_db()
    out = []
    for info in optim_db:
        if info.optim_cls in MIRRORS and info.optim_error_inputs_func is not None:
            for error in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
                out.append(pytest.param(info.optim_cls, error, id=(
                    f"{info.optim_cls.__name__}-{error.optimizer_error_input.desc}")))  # fmt: skip
    return out


def _build(cls, params, kwargs):
    if cls is HybridSGD and "lr" not in kwargs:
        kwargs = {**kwargs, "lr": 1e-2}  # torch's SGD has a default lr; HybridSGD too, since 2.x
    return cls(params, **kwargs, **OFFLOADED)


@pytest.mark.parametrize("torch_cls, error", _cases())
def test_torch_error_inputs_fail_as_in_torch(torch_cls, error):
    cls = MIRRORS[torch_cls]
    oi = error.optimizer_error_input
    kind, pattern = DEPARTURES.get(oi.desc, (error.error_type, error.error_regex))
    step = getattr(error, "error_on", None) is not None and error.error_on.name == "STEP_ERROR"

    def call():
        opt = _build(cls, oi.params, dict(oi.kwargs))
        if step:
            opt.step()

    if issubclass(kind, Warning):
        with pytest.warns(kind, match=pattern):
            call()
    else:
        with pytest.raises(kind, match=pattern):
            call()


def test_torch_lists_the_cases_this_file_was_written_for():
    """The five cases of torch 2.13-2.15's list that the hybrids once failed on (the message
    or the exception) are still among the inputs above, for AdamW and Adam."""
    descs = {c.values[1].optimizer_error_input.desc for c in _cases() if c.values[0] in
             (torch.optim.AdamW, torch.optim.Adam)}  # fmt: skip
    assert {"a param group cannot have duplicate parameters",
            "lr as Tensor doesn't work with foreach & not capturable",
            "betas must be either both floats or both Tensors"} <= descs  # fmt: skip
    assert any(d.startswith(r"betas\[0\] as a Tensor") for d in descs), descs


def p(*shape) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape))


@pytest.mark.parametrize("cls", [HybridAdamW, HybridAdam])
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=torch.tensor(1e-3), foreach=True),
         "lr as a Tensor is not supported for capturable=False and foreach=True"),
        (dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),
         "betas[0] as a Tensor is not supported for capturable=False and foreach=True"),
        (dict(betas=(0.9, torch.tensor(0.99))), "betas must be either both floats or both Tensors"),
        (dict(betas=(torch.tensor(0.9), 0.99)), "betas must be either both floats or both Tensors"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
        (dict(betas=(1.0, 0.99)), "Invalid beta parameter at index 0: 1.0"),
    ],
)  # fmt: skip
def test_tensor_hyperparameters_are_refused_in_torchs_words(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(None, **kwargs, **OFFLOADED)  # torch checks them before it reads the params
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([p(4)], **kwargs, **OFFLOADED)


def test_tensor_betas_train_as_torchs_adamw():
    """Both betas as Tensors (no foreach): accepted, and the update is torch's fused AdamW's."""
    a = p(3, 5)
    b = torch.nn.Parameter(a.detach().clone())
    betas = lambda: (torch.tensor(0.8), torch.tensor(0.95))  # noqa: E731 - one fresh pair each
    ours = HybridAdamW([a], lr=0.1, betas=betas(), **OFFLOADED)
    ref = torch.optim.AdamW([b], lr=0.1, betas=betas(), fused=True)
    for seed in range(3):
        g = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # CPU fp32: bitwise


def test_a_param_listed_twice_warns_as_torch_and_is_updated_once():
    x = p(6)
    y = torch.nn.Parameter(x.detach().clone())
    with pytest.warns(UserWarning, match="duplicate parameters") as record:
        twice = HybridAdamW([x, x], lr=0.1, **OFFLOADED)
    assert record[0].filename == __file__  # the caller's line, not one inside the package
    once = HybridAdamW([y], lr=0.1, **OFFLOADED)
    assert len(twice.param_groups[0]["params"]) == 1
    for _ in range(2):
        x.grad, y.grad = torch.ones(6), torch.ones(6)
        twice.step()
        once.step()
    torch.testing.assert_close(x, y, rtol=0, atol=0)
    named = torch.nn.Parameter(torch.zeros(2))
    with pytest.warns(
        UserWarning, match=r"\(offloadopt: 'w again' is 'w' listed again, shape \(2,\)"
    ):
        HybridAdamW([("w", named), ("w again", named)], **OFFLOADED)


def test_a_set_of_params_is_refused_not_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning first: the refusal is the answer
        with pytest.raises(TypeError, match="ordered collections"):
            HybridAdamW({p(2), p(3)}, **OFFLOADED)


@pytest.mark.parametrize(
    "ours_cls, torch_cls, kwargs",
    [
        (HybridAdamW, torch.optim.AdamW, dict(eps=1e-6, weight_decay=0.1)),
        (HybridAdam, torch.optim.Adam, dict(weight_decay=0.1)),
        (HybridSGD, torch.optim.SGD, dict(momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ],
)  # fmt: skip
def test_numpy_float32_hyperparameters_train_as_torchs(ours_cls, torch_cls, kwargs):
    """np.float32 is no Python float, yet torch takes it for every number (a LambdaLR whose
    lambda returns one puts it into the group's lr): at construction and at each step (torch
    refuses numpy betas at construction only, "both floats or both Tensors", not in a group)."""
    import numpy as np  # one of offloadopt's dependencies

    f32 = lambda v: tuple(map(np.float32, v)) if isinstance(v, tuple) else np.float32(v)  # noqa: E731
    kwargs = {k: f32(v) for k, v in kwargs.items()}
    a = p(3, 5)
    b = torch.nn.Parameter(a.detach().clone())
    ours = ours_cls([a], lr=np.float32(0.1), **kwargs, **OFFLOADED)
    ref = torch_cls([b], lr=np.float32(0.1), **kwargs, fused=True)
    decay = lambda step: np.float32(0.5) ** step  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (ours, ref)]
    if "betas" in ours.defaults:
        for o in (ours, ref):
            o.param_groups[0]["betas"] = f32((0.8, 0.95))
    for seed in range(3):
        g = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
    assert isinstance(ours.param_groups[0]["lr"], np.float32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # CPU fp32: bitwise


@pytest.mark.parametrize("cls", [HybridAdamW, HybridAdam, HybridSGD])
def test_fused_with_foreach_is_refused_as_torch_refuses_it(cls):
    # A user's find: fused=True with foreach=True was accepted; torch raises
    ref = next(k for k, v in MIRRORS.items() if v is cls)
    with pytest.raises(
        RuntimeError, match="`fused` and `foreach` cannot be `True` together"
    ) as theirs:
        ref([p(4)], lr=0.1, fused=True, foreach=True)
    with pytest.raises(RuntimeError) as ours:
        cls([p(4)], lr=0.1, fused=True, foreach=True, **OFFLOADED)
    assert str(ours.value) == str(theirs.value)
    cls([p(4)], lr=0.1, fused=True, foreach=False, **OFFLOADED)  # either alone: accepted


def test_sgd_takes_a_tensor_lr_with_foreach_as_torch_does():
    # SGD has no Tensor-lr check for foreach (Adam's): passing foreach on must not add one
    lr = torch.tensor(0.1)
    torch.optim.SGD([p(4)], lr=lr, foreach=True)
    HybridSGD([p(4)], lr=lr, foreach=True, **OFFLOADED)


def test_the_amsgrad_refusal_names_the_value_given():
    # A user's find: amsgrad="no" was refused as "amsgrad=True"
    with pytest.raises(
        NotImplementedError,
        match=r"does not support amsgrad=True yet \(got amsgrad='no', which torch reads as True\)",
    ):
        HybridAdamW([p(4)], amsgrad="no", **OFFLOADED)
