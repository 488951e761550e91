"""HybridDeviceOptimizer: Megatron-Core's constructor, class mapping and placement, on the CPU
(the CPU stands in for the GPU). The scenarios of Megatron-LM's own unit tests for its
HybridDeviceOptimizer (state made at the first step, state on the right side, weights against
the GPU optimizer alone), written here for offloadopt; tests/cuda runs them on the GPU."""

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_bitwise

from offloadopt import HybridAdam, HybridAdamW, HybridDeviceOptimizer, HybridSGD


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 5)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def groups(params, with_groups):
    if not with_groups:
        return list(params)
    params = list(params)
    half = len(params) // 2
    return [{"params": params[:half], "wd_mult": 1.0, "lr_mult": 1e-4},
            {"params": params[half:], "wd_mult": 0.0, "lr_mult": 2e-4}]  # fmt: skip


CLASSES = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@pytest.mark.parametrize("n_steps", [1, 10])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fraction", [0, 0.5, 1.0])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("with_groups", [False, True])
def test_megatron_scenarios(with_groups, optimizer, fraction, overlap, n_steps):
    torch.manual_seed(42)
    net, ref_net = Net(), Net()
    ref_net.load_state_dict(net.state_dict())
    cls = CLASSES[optimizer]
    hdo = HybridDeviceOptimizer(groups(net.parameters(), with_groups), offload_fraction=fraction,
                                lr=1e-3, overlap_cpu_optimizer_d2h_h2d=overlap,
                                cpu_optimizer_cls=cls, gpu_optimizer_cls=cls)  # fmt: skip
    ref = cls(groups(ref_net.parameters(), with_groups), lr=1e-3, fused=True)
    assert len(hdo.state_dict()["state"]) == 0  # state is made at the first step
    for step in range(n_steps):
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        for model, opt in ((net, hdo), (ref_net, ref)):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        if step == 0 and optimizer == "adam":
            sd = hdo.state_dict()
            assert len(sd["state"]) != 0
            first, last = sd["param_groups"][0]["params"][0], sd["param_groups"][-1]["params"][-1]
            params = [p for g in hdo.param_groups for p in g["params"]]
            assert hdo.is_offloaded(params[first]) == (fraction > 0)
            assert hdo.is_offloaded(params[last]) == (fraction == 1.0)
            assert sd["state"][first]["exp_avg"].device.type == "cpu"
    assert_bitwise(list(net.parameters()), list(ref_net.parameters()), "against torch's fused")
    assert {g.get("wd_mult") for g in hdo.param_groups} == ({1.0, 0.0} if with_groups else {None})


def test_megatron_placement_is_registration_order_by_numel_and_may_overshoot():
    net = Net()
    numels = [p.numel() for p in net.parameters()]
    hdo = HybridDeviceOptimizer(net.parameters(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.Adam)  # fmt: skip
    host = [pl.offloaded for pl in hdo.placement]
    k = host.index(False)
    assert all(host[:k]) and not any(host[k:])  # a prefix, in registration order
    assert sum(numels[: k - 1]) < 0.5 * sum(numels) <= sum(numels[:k])  # the last one overshoots
    assert (
        hdo.min_offload_numel == 0
        and HybridAdam(net.parameters()).placement_policy == "state-bytes"
    )


@pytest.mark.parametrize(
    "cpu,gpu,kw,expected",
    [
        (torch.optim.Adam, None, {}, "Adam"),
        (torch.optim.AdamW, torch.optim.AdamW, {}, "AdamW"),
        (functools.partial(torch.optim.Adam, betas=(0.8, 0.9)), None, {}, "Adam"),
        (functools.partial(torch.optim.Adam, decoupled_weight_decay=True), None, {}, "AdamW"),
        (None, torch.optim.SGD, dict(momentum=0.9), "SGD"),
        (torch.optim.Adam, types.new_class("FusedAdam"), {}, "Adam"),  # weight_decay 0: one rule
        (torch.optim.Adam, None, dict(decoupled_weight_decay=True, weight_decay=0.1), "AdamW"),
        (types.new_class("FusedAdam"), None, dict(adam_w_mode=False), "Adam"),
    ],
)
def test_classes_map_onto_one_rule(cpu, gpu, kw, expected):
    for cls in (cpu, gpu):
        if isinstance(cls, type) and cls.__name__ == "FusedAdam":
            cls.__module__ = "transformer_engine.pytorch.optimizers"
    hdo = HybridDeviceOptimizer(
        Net().parameters(), cpu_optimizer_cls=cpu, gpu_optimizer_cls=gpu, **kw
    )
    assert hdo.rule.name == expected
    if isinstance(cpu, functools.partial) and "betas" in cpu.keywords:
        assert hdo.param_groups[0]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cpu_optimizer_cls=torch.optim.RMSprop), "RMSprop.* is not an optimizer class offloadopt can map"),
        (dict(), "needs cpu_optimizer_cls or gpu_optimizer_cls"),
        (dict(cpu_optimizer_cls=torch.optim.Adam, gpu_optimizer_cls=torch.optim.SGD), "different update rules"),
        (dict(cpu_optimizer_cls=torch.optim.Adam, momentum=0.9), r"unexpected keyword arguments \['momentum'\]"),
        (dict(cpu_optimizer_cls=torch.optim.Adam, gpu_optimizer_cls=torch.optim.AdamW, weight_decay=0.1),
         "different update rules"),
    ],
)  # fmt: skip
def test_unmappable_setups_are_refused_naming_what(kw, match):
    with pytest.raises(TypeError, match=match):
        HybridDeviceOptimizer(Net().parameters(), **kw)


def test_param_update_in_fp32_keeps_masters_for_bf16_and_none_without():
    net = Net().bfloat16()
    with_masters = HybridDeviceOptimizer(net.parameters(), offload_fraction=1.0, param_update_in_fp32=True,
                                         cpu_optimizer_cls=torch.optim.Adam)  # fmt: skip
    without = HybridDeviceOptimizer(
        net.parameters(), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.Adam
    )
    net(torch.randn(1, 3, 32, 32, dtype=torch.bfloat16)).float().sum().backward()
    with_masters.step()
    without.step()
    p = next(net.parameters())
    assert with_masters.state[p]["master"].dtype == torch.float32
    assert "master" not in without.state[p] and without.state[p]["exp_avg"].dtype == torch.bfloat16


def test_the_native_classes_are_the_same_machinery():
    assert issubclass(HybridDeviceOptimizer, type(HybridAdamW(Net().parameters())).__mro__[1])
    assert HybridSGD.rule.name == "SGD" and HybridAdam.rule.name == "Adam"


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_unsupported_kernel_flags_are_refused_naming_this_class(flag):
    """A new user's find: capturable=True, which the docstring's "kernel-choice flags are
    accepted" seemed to cover, raised an error naming HybridAdamW."""
    m = torch.nn.Linear(8, 8)
    with pytest.raises(
        NotImplementedError, match=rf"^HybridDeviceOptimizer does not support {flag}=True"
    ):
        HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=torch.optim.AdamW,
                              gpu_optimizer_cls=torch.optim.AdamW, lr=1e-3, **{flag: True})  # fmt: skip
    HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=torch.optim.AdamW,
                          gpu_optimizer_cls=torch.optim.AdamW, lr=1e-3, **{flag: False})  # fmt: skip
