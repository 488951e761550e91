"""The device path of the compressed-state update on the GPU: reference.adam_step_flat is
bitwise the per-tensor reference adam_step on CUDA tensors in every mode (divisions by a host
scalar are multiplications by its reciprocal there, and the flat pass follows), passes cut
anywhere give the bits of one pass, and the pass makes no host sync; the compiled pass (the
default on CUDA) lands near the eager one, makes no host sync once compiled, and a new lr or
loss scale does not recompile it. Run on the GPU host."""

import pytest
import torch

from offloadopt.kernels import adam, reference

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/cuda run on the GPU host)")


def _cuda_mode(master_bf16, moments, wout):
    from test_device_path import SIZES
    from test_kernels import make_mode

    x = [[t.cuda() for t in lst] for lst in make_mode(SIZES, 4, master_bf16, moments)]
    w = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in SIZES] if wout else []
    return x, w


@pytest.mark.parametrize("hp", [0, 1, 2], ids=["adamw", "adam-max-scaled", "no-wd"])
@pytest.mark.parametrize("mode", range(8))
def test_flat_is_bitwise_the_per_tensor_reference_on_cuda(mode, hp):
    from test_device_path import HYPER, MODES, assert_lists_bitwise, call_kwargs
    from test_kernels import kcall

    master_bf16, moments, wout = MODES[mode]
    a, wa = _cuda_mode(master_bf16, moments, wout)
    b, wb = [[t.clone() for t in lst] for lst in a], [w.clone() for w in wa]
    kw = call_kwargs(moments, master_bf16, **HYPER[hp])
    for _ in range(2):
        kcall(reference.adam_step, *a[:4], sms=a[4], svs=a[5], wout=wa, **kw)
        kcall(reference.adam_step_flat, *b[:4], sms=b[4], svs=b[5], wout=wb, **kw)
        kw["steps"] = [s + 1 for s in kw["steps"]]
    torch.cuda.synchronize()
    cpu = [[t.cpu() for t in lst] for lst in (*a, wa)], [[t.cpu() for t in lst] for lst in (*b, wb)]
    assert_lists_bitwise(*cpu, "flat vs per tensor on cuda")


@pytest.mark.parametrize("mode", [3, 4, 5, 7])
def test_passes_on_cuda_give_the_bits_of_one_pass_without_a_host_sync(mode):
    from test_device_path import MODES, _args, assert_lists_bitwise, call_kwargs

    master_bf16, moments, wout = MODES[mode]
    a, wa = _cuda_mode(master_bf16, moments, wout)
    b, wb = [[t.clone() for t in lst] for lst in a], [w.clone() for w in wa]
    kw = call_kwargs(moments, master_bf16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing op raises
    try:
        reference.adam_step_flat(**_args(*a[:4], a[4], a[5], wa, **kw))
        adam.device_step(max_numel=1024, compiled=False, **_args(*b[:4], b[4], b[5], wb, **kw))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    cpu = [[t.cpu() for t in lst] for lst in (*a, wa)], [[t.cpu() for t in lst] for lst in (*b, wb)]
    assert_lists_bitwise(*cpu, "passes vs one pass on cuda")


@pytest.mark.parametrize("mode", range(8))
def test_the_compiled_pass_lands_near_the_eager_one_on_cuda(mode):
    from test_device_path import HYPER, MODES, _args, assert_near_eager, call_kwargs

    master_bf16, moments, wout = MODES[mode]
    a, wa = _cuda_mode(master_bf16, moments, wout)
    b, wb = [[t.clone() for t in lst] for lst in a], [w.clone() for w in wa]
    kw = call_kwargs(moments, master_bf16, **HYPER[0])
    for lr, scale in ((1e-3, None), (3e-4, 2.0)):
        kw.update(lr=lr, grad_scale=scale)
        reference.adam_step_flat(**_args(*a[:4], a[4], a[5], wa, **kw))
        adam.device_step(**_args(*b[:4], b[4], b[5], wb, **kw))  # compiled: CUDA's default
        kw["steps"] = [s + 1 for s in kw["steps"]]
    torch.cuda.synchronize()
    cpu = [[t.cpu() for t in lst] for lst in (*a, wa)], [[t.cpu() for t in lst] for lst in (*b, wb)]
    assert_near_eager(*cpu, moments, "compiled vs eager on cuda")


def test_the_compiled_pass_makes_no_host_sync_and_a_new_lr_does_not_recompile():
    from test_device_path import MODES, _args, call_kwargs
    from torch._dynamo.utils import counters

    master_bf16, moments, wout = MODES[7]
    b, wb = _cuda_mode(master_bf16, moments, wout)
    kw = call_kwargs(moments, master_bf16)
    adam.device_step(compiled=True, **_args(*b[:4], b[4], b[5], wb, **kw))  # compiles
    torch.cuda.synchronize()
    graphs = counters["stats"]["unique_graphs"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for lr in (3e-4, 1e-4):
            kw.update(lr=lr, grad_scale=lr * 1e4)
            kw["steps"] = [s + 1 for s in kw["steps"]]
            adam.device_step(compiled=True, **_args(*b[:4], b[4], b[5], wb, **kw))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_optimizers_device_path_makes_no_host_sync():
    """Device-resident params under compressed state keep their step on the CPU (the flat pass
    computes its scalars on the host): the update reads it without waiting for the GPU, where a
    step on the device cost a host sync every step (`.tolist()` in adam_update)."""
    from offloadopt import HybridAdamW

    params = [torch.nn.Parameter(torch.randn(300, 7, device="cuda").bfloat16()) for _ in range(3)]
    opt = HybridAdamW(params, lr=1e-3, offload_fraction=0.0, state_dtype="int8",
                      master_weights="bf16-sr")  # fmt: skip
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # makes the state, compiles the pass
    assert all(opt.state[p]["step"].device.type == "cpu" for p in params)
    keys = ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
    states = [[opt.state[p][k] for p in params] for k in keys]
    steps = [opt.state[p]["step"] for p in params]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adam.adam_update(opt.rule, opt.param_groups[0], [p.data for p in params],
                         [p.grad for p in params], states, steps, host=False, amp=None,
                         where=[(i, 0) for i in range(3)])  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)
