"""transfer.py's per-bucket launch plans (the operands the worker's CUDA copies reuse every step):
made once per bucket and slot, made again when what they point into moves, dropped with the
bucket. The copies themselves need CUDA (tests/cuda); the plans' bookkeeping does not."""

import gc
import weakref

import torch

from offloadopt import HybridAdamW
from offloadopt.transfer import Slot


def _setup():
    params = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(40))]
    opt = HybridAdamW(params, lr=1e-2, offload_fraction=1.0, min_offload_numel=1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    b = opt.buckets[0]
    tr = opt._pipeline.transfers[b.arena.device]
    n = tr.nbytes
    # a slot with device-side halves, as on CUDA (here plain CPU buffers)
    slot = Slot(0, tr.ring.slots[0].host, torch.zeros(n, dtype=torch.uint8),
                torch.zeros(n, dtype=torch.uint8))  # fmt: skip
    return opt, params, b, tr, slot


def test_a_plan_is_made_once_per_bucket_and_slot_and_points_where_the_views_do():
    opt, params, b, tr, slot = _setup()
    plan = tr._plan(b, slot)
    assert tr._plan(b, slot) is plan
    other = Slot(1, slot.host, torch.zeros_like(slot.d2h), torch.zeros_like(slot.h2d))
    assert tr._plan(b, other) is not plan  # another slot: its own operands
    for mine, theirs in zip(plan.d2h_views, b.slot_views(slot.d2h), strict=True):
        assert mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape
    assert plan.host_flat.data_ptr() == slot.host.data_ptr() and plan.host_flat.numel() == b.nbytes
    assert plan.master_bytes.data_ptr() == b.arena.master[b.lo : b.hi].data_ptr()
    assert plan.master_bytes.numel() == b.nbytes
    opt.close()


def test_a_plan_follows_a_moved_master_and_rebound_params():
    opt, params, b, tr, slot = _setup()
    plan = tr._plan(b, slot)
    views = tr._param_views(b, plan)
    assert tr._param_views(b, plan) is views  # nothing moved: kept
    params[0].data = params[0].data.clone()  # a caller rebinds p.data between steps
    moved = tr._param_views(b, plan)
    assert moved is not views
    assert [v.data_ptr() for v in moved] == [v.data_ptr() for v in b.param_views()]
    b.arena.master = b.arena.master.clone()  # the arena's master moved (never done in place)
    again = tr._plan(b, slot)
    assert again is not plan
    assert again.master_bytes.data_ptr() == b.arena.master[b.lo : b.hi].data_ptr()
    opt.close()


def test_a_new_placement_lets_the_old_buckets_and_their_host_buffers_go():
    """set_offload_fraction (and auto's move) makes new buckets; the transfer kept each old
    bucket as the key of its last H2D's event (on CUDA), and an old bucket's cached views
    kept its arena's master and moments alive: host memory held twice until the staging was
    replaced. The CUDA path's bookkeeping is recorded here by hand."""
    opt, params, b, tr, slot = _setup()
    tr._plan(b, slot)
    for old in opt.buckets:
        tr.h2d_done[old] = None  # what start_h2d records on CUDA
    old_bucket, old_arena = weakref.ref(b), weakref.ref(b.arena)
    master = weakref.ref(b.arena.master)
    del b, old, slot
    opt.set_offload_fraction(0.5)
    gc.collect()
    assert old_bucket() is None and old_arena() is None and master() is None
    assert len(tr._plans) == 0 and all(nb in opt.buckets for nb in tr.h2d_done)
    for p in params:  # and the optimizer goes on
        p.grad = torch.randn_like(p)
    opt.step()
    opt.close()
