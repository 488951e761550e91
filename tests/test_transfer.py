"""transfer.py's per-bucket launch plans (the operands the worker's CUDA copies reuse every step):
made once per bucket and slot, made again when what they point into moves, dropped with the
bucket. The copies themselves need CUDA (tests/cuda); the plans' bookkeeping does not."""

import gc
import weakref

import torch

from offloadopt import HybridAdamW
from offloadopt.link.transfer import Slot


def _setup():
    params = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(40))]
    opt = HybridAdamW(params, lr=1e-2, offload_fraction=1.0, min_offload_numel=1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    b = opt.buckets[0]
    tr = opt.debug.pipeline.transfers[b.arena.device]
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


def _aliases(tensor: torch.Tensor, plan) -> bool:
    """Whether any tensor kept in ``plan`` points into ``tensor``'s memory."""
    lo = tensor.untyped_storage().data_ptr()
    hi = lo + tensor.untyped_storage().nbytes()
    kept = []
    for v in vars(plan).values():
        kept += v if isinstance(v, list) else list(v.values()) if isinstance(v, dict) else [v]
    return any(isinstance(t, torch.Tensor) and lo <= t.data_ptr() < hi for t in kept)


def test_the_h2d_writes_whole_params_and_parts_and_keeps_no_view_of_a_param():
    params = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(40))]
    # 1 KiB buckets: the (48, 16) param is cut, the (40,) one lies whole in a bucket
    opt = HybridAdamW(params, lr=1e-2, offload_fraction=1.0, min_offload_numel=1,
                      bucket_nbytes=1024)  # fmt: skip
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    tr = opt.debug.pipeline.transfers[params[0].device]
    n = tr.nbytes
    slot = Slot(0, tr.ring.slots[0].host, torch.zeros(n, dtype=torch.uint8),
                torch.zeros(n, dtype=torch.uint8))  # fmt: skip
    seen_whole = seen_part = False
    for b in opt.buckets:
        plan = tr._plan(b, slot)
        idx = list(range(len(b.segments)))
        targets, sources = tr._h2d_pairs(b, plan.h2d_views, plan.shaped, idx)
        for s, t, src, view in zip(b.segments, targets, sources, b.param_views(), strict=True):
            p = b.arena.params[s.k]
            whole = s.lo == 0 and s.hi == p.numel()
            seen_whole, seen_part = seen_whole or whole, seen_part or not whole
            assert (
                (t is p) if whole else (t.data_ptr() == view.data_ptr() and t.shape == view.shape)
            )
            assert src.numel() == t.numel() and src.shape == t.shape
        del targets, sources, t, view
        for p in params:
            assert not _aliases(p, plan)  # a rebound param's old memory would stay alive
    assert seen_whole and seen_part
    # a param rebound to another shape (same elements): its source view follows
    whole_bucket = next(b for b in opt.buckets for s in b.segments
                        if b.arena.params[s.k] is params[1])  # fmt: skip
    plan = tr._plan(whole_bucket, slot)
    params[1].data = params[1].data.view(5, 8).clone()
    i = next(i for i, s in enumerate(whole_bucket.segments)
             if whole_bucket.arena.params[s.k] is params[1])  # fmt: skip
    targets, sources = tr._h2d_pairs(whole_bucket, plan.h2d_views, plan.shaped, [i])
    assert targets[0] is params[1] and sources[0].shape == (5, 8)
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


class _FakeEvent:
    """A timing event at ``t`` ms whose copy is done once ``clock[0] >= t``."""

    def __init__(self, t: float, clock: list):
        self.t, self.clock, self.waited = t, clock, False

    def query(self) -> bool:
        return self.clock[0] >= self.t

    def synchronize(self) -> None:
        self.waited = True
        self.clock[0] = max(self.clock[0], self.t)

    def elapsed_time(self, end) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not yet done"
        return end.t - self.t


def test_link_times_hold_few_events_however_long_nothing_reads_them():
    # A review's finding: every bucket's copies added two CUDA events per direction to a list
    # that only opt.stats emptied; a run that never read stats grew it by ~370 events a step
    # (GPT-2 1.5B, backward mode). Completed pairs are now folded into sums as they come.
    from offloadopt.link.times import FOLD_AT, LinkTimes

    clock = [0.0]
    times = LinkTimes()
    expected = {"d2h_ms": [0.0, 0], "h2d_ms": [0.0, 0]}
    for i in range(5000):
        key = "d2h_ms" if i % 3 else "h2d_ms"
        start, end = _FakeEvent(i * 10.0, clock), _FakeEvent(i * 10.0 + 1 + i % 7, clock)
        times.add(key, start, end, 100 + i)
        expected[key][0] += 1 + i % 7
        expected[key][1] += 100 + i
        clock[0] = i * 10.0 - 30  # the GPU runs a few copies behind the worker
        assert len(times) <= FOLD_AT + 8
    in_flight = [e for q in times._queues.values() for _, e, _ in q if not e.query()]
    assert in_flight  # the pairs still running are kept, not folded early
    got = times.take()  # waits for those
    assert all(e.waited for e in in_flight)
    for key, (ms, n) in expected.items():
        assert got[key][0] == ms and got[key][1] == n, key
    assert len(times) == 0 and times.take() == {"d2h_ms": (0.0, 0), "h2d_ms": (0.0, 0)}
