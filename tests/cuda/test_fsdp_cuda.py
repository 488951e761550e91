"""HybridAdamW under FSDP2 and DDP on the GPU, one rank (NCCL): the single-GPU path's results
bitwise, no pageable copies, FSDP2's own CPU offload refused. Run on the GPU host."""

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from offloadopt import HybridAdamW
from offloadopt.audit import audit
from offloadopt.harness.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=128, block_size=32)


@pytest.fixture(scope="module")
def group():
    from offloadopt.harness.anchors import _single_rank_group

    with mock.patch.dict(os.environ):
        _single_rank_group(torch.device("cuda"))
        yield
        dist.destroy_process_group()


def model(sharded: bool, **shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = GPT(CFG).cuda()
    if sharded:
        mesh = init_device_mesh("cuda", (1,))
        for block in m.transformer.h:
            fully_shard(block, mesh=mesh, **shard)
        fully_shard(m, mesh=mesh, **shard)
    return m


def train(m, opt, steps=5):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g).cuda()
        m(seq[:, :-1], seq[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in m.named_parameters()}  # fmt: skip


@pytest.mark.parametrize("kw", [dict(offload_fraction=0.5), dict(offload_fraction=1.0),
                                dict(offload_fraction=1.0, overlap="delayed"),
                                dict(offload_fraction=0.5, max_grad_norm=0.1),
                                # hooks after each reduce-scatter, on FSDP2's post-reduce stream
                                dict(offload_fraction=1.0, overlap="backward", grads_final=True),
                                dict(offload_fraction=1.0, overlap="backward", max_grad_norm=0.1,
                                     release_grads=True),
                                # each FSDP2 module waits, and makes FSDP2's all-gather wait
                                dict(offload_fraction=1.0, wait="module"),
                                dict(offload_fraction=1.0, overlap="backward", grads_final=True,
                                     wait="module")], ids=str)  # fmt: skip
def test_fsdp2_one_rank_is_bitwise_the_single_gpu_path(group, kw):
    kw = {"lr": 1e-2, "min_offload_numel": 64, **kw}

    def hybrid(m):
        opt = HybridAdamW(m.parameters(), **kw)
        if kw.get("wait") == "module":
            opt.watch(m)
        return opt

    plain = train(m := model(False), hybrid(m))
    sharded = train(m := model(True), opt := hybrid(m))
    assert opt.host_nbytes > 0
    for name in plain:
        assert torch.equal(plain[name], sharded[name]), name


@pytest.mark.parametrize("kw", [dict(offload_fraction=0.5, grads_final=True),
                                dict(offload_fraction=1.0, max_grad_norm=0.1)], ids=str)  # fmt: skip
def test_ddp_grad_source_one_rank_is_bitwise_the_single_gpu_path(group, kw):
    from torch.nn.parallel import DistributedDataParallel

    kw = {"lr": 1e-2, "min_offload_numel": 64, "overlap": "backward", "bucket_nbytes": 2**16, **kw}
    plain = train(m := model(False), HybridAdamW(m.parameters(), **kw))
    ddp = DistributedDataParallel(model(False), gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    opt = HybridAdamW(ddp.parameters(), ddp=ddp, **kw)
    wrapped = train(ddp, opt)
    assert len(opt.buckets) > 1
    for name in plain:
        assert torch.equal(plain[name], wrapped[f"module.{name}"]), name


def test_fsdp2_step_makes_no_pageable_copy(group):
    m = model(True)
    opt = HybridAdamW(m.parameters(), lr=1e-3, offload_fraction=1.0, min_offload_numel=64)
    train(m, opt, steps=2)
    seq = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), device="cuda")
    torch.cuda.synchronize()
    with audit() as a:  # one step, the batch already on the GPU (the test's own copies out)
        m(seq[:, :-1], seq[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    assert a.report.pageable_count == 0, a.report.rows
    assert sum(r.count for r in a.report.rows if r.direction in ("HtoD", "DtoH")) > 0


def test_fsdp2_cpu_offload_policy_is_refused_before_anything_is_built(group):
    from torch.distributed.fsdp import CPUOffloadPolicy

    m = model(True, offload_policy=CPUOffloadPolicy(pin_memory=True))
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        HybridAdamW(m.parameters(), offload_fraction=1.0)
