"""HybridDeviceOptimizer on the GPU: Megatron-LM's scenarios (tests/test_megatron_compat.py) with
CUDA params, against torch's fused optimizers on the GPU."""

import pytest
import torch
from test_megatron_compat import CLASSES, Net, groups

from offloadopt import HybridDeviceOptimizer

# The CPU kernel against torch's CUDA kernel: they round differently (tests/cuda/
# test_optim_cuda.py measures 9.54e-6 after 20 AdamW steps of N(0, 1) params); 10 steps here.
ATOL = 1e-5


@pytest.mark.parametrize("fraction", [0, 0.5, 1.0])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("with_groups", [False, True])
def test_megatron_scenarios_on_the_gpu(with_groups, optimizer, fraction):
    torch.manual_seed(42)
    net, ref_net = Net().cuda(), Net().cuda()
    ref_net.load_state_dict(net.state_dict())
    cls = CLASSES[optimizer]
    hdo = HybridDeviceOptimizer(groups(net.parameters(), with_groups), offload_fraction=fraction,
                                lr=1e-3, cpu_optimizer_cls=cls, gpu_optimizer_cls=cls)  # fmt: skip
    ref = cls(groups(ref_net.parameters(), with_groups), lr=1e-3, fused=True)
    assert len(hdo.state_dict()["state"]) == 0
    for step in range(10):
        x = torch.randn(1, 3, 32, 32, device="cuda")
        for model, opt in ((net, hdo), (ref_net, ref)):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        if step == 0 and optimizer == "adam":
            sd = hdo.state_dict()
            first, last = sd["param_groups"][0]["params"][0], sd["param_groups"][-1]["params"][-1]
            assert sd["state"][first]["exp_avg"].is_cuda == (fraction == 0)
            assert sd["state"][last]["exp_avg"].is_cuda == (fraction < 1)
    for p, q in zip(net.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=ATOL)
    assert all(t.is_pinned() for _, t in hdo.crossing_host_tensors())
