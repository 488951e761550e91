"""Device-resident compressed state in flat buffers, owned by :class:`DeviceFlat`, and its
update in passes over them: no gather, scatter or slice per tensor, no host sync.

A *set* is device-resident params of one param group that share a device and a kind: bf16
params whose fp32 master is in the state, or params that are their own master (fp32 params;
bf16 params under ``master_weights="bf16-sr"``). Its state lives in flat buffers, each
param's segment padded to ``BLOCK`` so that an int8 block never mixes two params (as
``kernels.reference.adam_step_flat`` pads them): the master where one is kept, each moment
(fp32, bf16 or uint8 codes) and each block-scale key, and a CPU buffer of the steps.
``opt.state[p]`` holds views of them, shaped as before, so ``state_dict()`` (which copies
every tensor: ``state.checkpoint.pack``; streamed saves clone a view, ``streamed._exact``),
``load_state_dict``, assignments and re-placement read and write the tensors they always did.

Per step and set, when every member has its grad: the steps advanced (one CPU op); the
per-block scalars filled in (two fills; members at different step counts, after a step some
of them missed: a per-member table spread over the blocks); the rounding keys, where a draw is
used, made on the device from the salts cached at build (``kernels.flat.key_table``);
then per pass of at most :data:`FLAT_CHUNK` elements: the grads copied into a workspace with
one multi-tensor copy (with the params too when they are their own master), the pads zeroed,
``kernels.flat.core_into`` over the pass, the new weights copied into the params with one
multi-tensor copy. Anything else takes the per-tensor path (step/device.py), to which the
views are plain tensors: the results are bitwise the same either way (tests/test_device_flat.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from offloadopt.kernels.adam import FLAT_NUMEL, MOMENT_CODES, device_step_mode, hyper_floats
from offloadopt.kernels.flat import core_into, key_table, signed64
from offloadopt.kernels.formats import BLOCK, nblocks
from offloadopt.kernels.reference import _consts, _f32, _step_scalars
from offloadopt.place.placement import update_dtype
from offloadopt.shards import is_dtensor

__all__ = ["DeviceFlat", "FlatSet", "takes_flat"]

# Elements per pass (a multiple of BLOCK): the workspace holds one pass of grads and of weights
# (4 to 8 bytes per element); the eager pass's temporaries, about 16 bytes per element, stay
# within kernels.adam.PASS_WORK_BYTES' count of FLAT_NUMEL_DEFAULT elements.
FLAT_CHUNK = {"cpu": FLAT_NUMEL["cpu"]}
FLAT_CHUNK_DEFAULT = 2**26


def takes_flat(device: torch.device) -> bool:
    """Whether device-resident compressed params on ``device`` may take the flat pass: where
    the device pass runs in torch ops (not on the CPU, whose params go to the C++ kernel:
    kernels.adam.adam_update), unless ``OFFLOADOPT_DEVICE_FLAT=0`` (the per-tensor path, to
    compare with)."""
    return device.type != "cpu" and os.environ.get("OFFLOADOPT_DEVICE_FLAT", "1") != "0"


class _Pass:
    """Elements ``[lo, hi)`` of a set's flat buffers, with every view a step needs made once.

    ``blocks``: its blocks ``[b0, b1)``; ``pieces``: per member in the pass ``(i, a, b, whole)``, its elements ``[a, b)`` (``whole``:
    all of them, and the views are shaped like the param); ``grads``: the workspace views its
    grads are copied into; ``weights``: the workspace views holding its weights (the params'
    own when they are their own master, else the new bf16 weights); ``masters``: the views of
    its fp32 masters (mastered sets); ``pads``: the pad ranges zeroed before the pass, one
    list per dtype; ``args``: :func:`kernels.flat.core_into`'s buffers; ``fl``, ``it``,
    ``first_b``: its per-block tables (at one step count for every member)."""

    def __init__(self, fs: FlatSet, lo: int, hi: int):
        self.pieces, self.grads, self.weights, self.masters = [], [], [], []
        pads: dict[torch.dtype, list[torch.Tensor]] = {}
        master = fs.flat.get("master")
        for i, p in enumerate(fs.members):
            o, n = fs.first[i] * BLOCK, fs.numels[i]
            g0, g1 = max(o, lo), min(o + nblocks(n) * BLOCK, hi)
            if g0 >= g1:
                continue
            a, b = g0 - o, min(g1, o + n) - o
            whole = a == 0 and b == n

            def piece(buf: torch.Tensor, start: int, p=p, a=a, b=b, whole=whole) -> torch.Tensor:
                v = buf[start : start + b - a]
                return v.view(p.shape) if whole else v

            self.pieces.append((i, a, b, whole))
            self.grads.append(piece(fs.ws_grad, g0 - lo))
            self.weights.append(piece(fs.ws_weights, g0 - lo))
            if master is not None:
                self.masters.append(piece(master, g0))
            if g1 > o + n:  # the pad: zero in the grads and the masters a pass reads
                pads.setdefault(fs.ws_grad.dtype, []).append(fs.ws_grad[o + n - lo : g1 - lo])
                own = master[o + n : g1] if master is not None else None
                pad = own if own is not None else fs.ws_weights[o + n - lo : g1 - lo]
                pads.setdefault(pad.dtype, []).append(pad)
        self.pads = list(pads.values())
        n, b0, b1 = hi - lo, lo // BLOCK, hi // BLOCK
        flat = [fs.flat[k] for k in fs.keys]
        elem = [f[lo:hi] for k, f in zip(fs.keys, flat, strict=True) if not fs.blockwise[k]]
        blk = [f[b0:b1] for k, f in zip(fs.keys, flat, strict=True) if fs.blockwise[k]]
        blk = blk or [None, None]  # fp32 / bf16 moments: no scales
        p_in = master[lo:hi] if master is not None else fs.ws_weights[:n]
        w_out = fs.ws_weights[:n] if master is not None else None
        self.blocks = (b0, b1)
        self.args = (p_in, fs.ws_grad[:n], elem[0], blk[0], elem[1], blk[1], w_out)
        self.fl, self.first_b = fs.fl_b[: b1 - b0], fs.first_b[: b1 - b0]
        self.it = fs.it_b[b0:b1] if fs.draws else fs.it_b[: b1 - b0]


class FlatSet:
    """One set's flat buffers, the views ``opt.state`` holds, and its passes.

    Args:
        members: the params (one device, dtype and group; contiguous), in their group's order.
        keys: the rule's state keys (kernel order); ``dtypes`` and ``blockwise`` per key.
        mastered: whether the state keeps an fp32 ``"master"`` (bf16 params).
        draws: whether the update draws rounding bits (a bf16 master or bf16 moments).
        salts: per member, its stochastic rounding's seed (``ParamRecord.salt``).
        chunk: elements per pass (a multiple of BLOCK).
        entries: None (fresh state: zeros, the views claimed by ``Updater.init_state``), or per
            member its state entry, copied in and given the views, one key at a time (so at
            most one key's worth of memory is held twice).
    """

    def __init__(self, members: list[torch.Tensor], keys: tuple[str, ...], dtypes: dict,
                 blockwise: dict, *, mastered: bool, draws: bool, salts: list[int],
                 chunk: int, entries: list[dict] | None = None):  # fmt: skip
        dev = self.device = members[0].device
        self.members, self.keys, self.blockwise = members, keys, blockwise
        self.dtype = members[0].dtype  # the params' and their grads'
        self.numels = [p.numel() for p in members]
        counts = [nblocks(n) for n in self.numels]
        self.first = [0]  # each member's first block
        for c in counts[:-1]:
            self.first.append(self.first[-1] + c)
        nb = sum(counts)
        total = nb * BLOCK
        self.views: list[dict[str, torch.Tensor]] = [{} for _ in members]
        self.steps = torch.zeros(len(members), dtype=torch.float32)  # (members,) fp32, CPU
        if entries is not None:
            self.steps.copy_(torch.stack([e["step"].detach().reshape(()).to("cpu", torch.float32)
                                          for e in entries]))  # fmt: skip
        self._install("step", [self.steps[i] for i in range(len(members))], entries)
        self.flat: dict[str, torch.Tensor] = {}
        for k in (("master",) if mastered else ()) + keys:
            block = blockwise.get(k, False)
            dtype = torch.float32 if k == "master" else dtypes[k]
            buf = self.flat[k] = torch.zeros(nb if block else total, dtype=dtype, device=dev)
            if block:  # (nblocks,) fp32 per member
                vs = [buf[f : f + c] for f, c in zip(self.first, counts, strict=True)]
            else:  # shaped like the member
                vs = [buf[f * BLOCK : f * BLOCK + n].view(p.shape)
                      for f, n, p in zip(self.first, self.numels, members, strict=True)]  # fmt: skip
            if entries is not None:
                torch._foreach_copy_(vs, [e[k] for e in entries])
            self._install(k, vs, entries)
        self.mastered = mastered
        self.key0, self.entry_len = keys[0], len(keys) + 1 + mastered
        self.view0 = [v[keys[0]] for v in self.views]
        self.master_views = [v["master"] for v in self.views] if mastered else []
        # per block: its member (made when first needed), and where a draw is used, the
        # rounding counter's base (BLOCK x its index in the member) and the keys' halves
        # written per step; else a pass's worth of zeros the pass never reads
        self.draws, self.counts, self.fl_all = draws, counts, None
        self._member: torch.Tensor | None = None
        per_pass = min(nb, chunk // BLOCK)
        if draws:
            member = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts))
            it_b = torch.zeros(nb, 5, dtype=torch.int64)  # (blocks, 5) int64, on the device
            it_b[:, 0] = (torch.arange(nb) - torch.tensor(self.first)[member]) * BLOCK
            self.it_b = it_b.to(dev)
        else:
            self.it_b = torch.zeros(per_pass, 5, dtype=torch.int64, device=dev)
        self.it_keys = self.it_b[:, 1:]
        self.salts = torch.tensor([signed64(s) for s in salts], dtype=torch.int64, device=dev)
        self.fl_b = torch.zeros(per_pass, 2, dtype=torch.float32, device=dev)  # step, denominator
        self.fl_cols = (self.fl_b[:, 0], self.fl_b[:, 1])
        self.first_b = torch.arange(per_pass, dtype=torch.int64, device=dev)
        self.sc = torch.zeros(2, dtype=torch.float32, device=dev)  # compiled: wd factor, scale
        ws = min(total, chunk)
        self.ws_grad = torch.zeros(ws, dtype=self.dtype, device=dev)  # (pass,) grads' dtype
        # (pass,): mastered, the new bf16 weights; else the params themselves as masters
        self.ws_weights = torch.zeros(ws, dtype=torch.bfloat16 if mastered else self.dtype,
                                      device=dev)  # fmt: skip
        self.passes = [_Pass(self, lo, min(lo + chunk, total)) for lo in range(0, total, chunk)]

    def _install(self, key: str, vs: list[torch.Tensor], entries: list[dict] | None) -> None:
        for i, v in enumerate(vs):
            self.views[i][key] = v
            if entries is not None:  # the entry's own tensor goes (a plain dict write: the
                dict.__setitem__(entries[i], key, v)  # entry's __setitem__ would copy into it)

    def member_of_block(self) -> torch.Tensor:
        """``(blocks,)`` int64 on the device: each block's member index (made once)."""
        if self._member is None:
            counts = torch.tensor(self.counts)
            member = torch.repeat_interleave(torch.arange(len(self.members)), counts)
            self._member = member.to(self.device)
        return self._member

    def per_block(self, rows: list) -> torch.Tensor:
        """``rows`` (one per member) spread over the set's blocks: ``(blocks, len(row))`` on
        the device (host values copied from pinned memory, no host sync)."""
        dtype = torch.float32 if isinstance(rows[0][0], float) else torch.int64
        table = torch.tensor(rows, dtype=dtype)
        if self.device.type == "cuda":
            table = table.pin_memory().to(self.device, non_blocking=True)
        else:
            table = table.to(self.device)
        return table.index_select(0, self.member_of_block())

    def valid(self, state: dict) -> bool:
        """Whether every member's state is still this set's views (a re-placement, a load
        without an entry, or a deleted entry replaces or drops them)."""
        k0, n = self.key0, self.entry_len
        for p, v in zip(self.members, self.view0, strict=True):
            e = dict.get(state, p)
            if e is None or len(e) != n or dict.get(e, k0) is not v:
                return False
        return True


class DeviceFlat:
    """Owns the flat buffers of the device-resident compressed state (module docstring).

    Args:
        rule: the optimizer's :class:`offloadopt.rules.Rule` (compressed: else nothing joins).
        records: param -> :class:`offloadopt.place.records.ParamRecord` (salts, state keys).
        state: ``opt.state``, whose entries hold the views.
        master_weights: whether bf16 params keep fp32 masters.
    """

    def __init__(self, rule: Any, records: dict, state: dict, *, master_weights: bool):
        self.rule, self.records, self.state = rule, records, state
        self.master_weights = master_weights
        self.where: dict[torch.Tensor, FlatSet] = {}  # param -> its set
        self.pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}  # reserved, unclaimed

    def kind(self, p: torch.Tensor) -> tuple | None:
        """``(device, dtype, mastered)`` of a param that may join a set, else None."""
        if not self.rule.compressed or is_dtensor(p) or not takes_flat(p.device):
            return None
        if not p.is_contiguous():
            return None
        udt = update_dtype(p.dtype, self.master_weights)
        if udt != p.dtype:  # an fp32 master: bf16 params only (the kernel reads bf16 grads)
            return (p.device, p.dtype, True) if p.dtype == torch.bfloat16 else None
        if p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and self.rule.master_sr):
            return (p.device, p.dtype, False)
        return None

    def reserve(self, params: list[torch.Tensor]) -> None:
        """Sets for ``params`` (device-resident, one group, no state yet) with zeroed buffers,
        whose views :meth:`claim` hands to ``Updater.init_state``: fresh state is made in the
        buffers, never beside them. The caller clears :attr:`pending` after."""
        for members in self._by_kind(params).values():
            fs = self._new_set(members, None)
            for p, views in zip(members, fs.views, strict=True):
                self.pending[p] = views

    def claim(self, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``p``'s reserved views (``"step"``, the state keys, ``"master"``), or None."""
        return self.pending.pop(p, None)

    def drop(self) -> None:
        """Forget every set: the next step lays the buffers out again from the per-param state
        (the re-placement calls this: its moved params have fresh tensors, and the sets would
        otherwise keep the old buffers until the next step found them stale)."""
        self.where.clear()

    def update(self, hyper: Any, params: list[torch.Tensor], scale, amp) -> tuple[list, list]:
        """The flat pass over each set whose members are exactly those of ``params`` it holds
        (one group's device-resident params with grads; sets made here for params with
        state but none); ``scale``: None, a clip factor or a tuple of them (0-dim tensors);
        ``amp``: a GradScaler's inputs or None. Returns ``(done, rest)``: the params updated,
        and those left to the per-tensor path."""
        if not params or not self.rule.compressed:
            return [], params
        sets: dict[FlatSet, list[torch.Tensor]] = {}
        orphans, rest = [], []
        for p in params:
            fs = self.where.get(p)
            if fs is not None:
                sets.setdefault(fs, []).append(p)
            else:
                (orphans if self.kind(p) is not None else rest).append(p)
        for fs in [fs for fs in sets if not fs.valid(self.state) or not takes_flat(fs.device)]:
            for q in fs.members:
                if self.where.get(q) is fs:
                    del self.where[q]
            orphans += [q for q in sets.pop(fs) if self.kind(q) is not None]
        if orphans:
            adopted = set()
            for kind, members in self._by_kind(orphans).items():
                members = [q for q in members if self._adoptable(q, kind[2])]
                if members:
                    entries = [dict.get(self.state, q) for q in members]
                    sets[self._new_set(members, entries)] = members
                    adopted.update(members)
            rest += [q for q in orphans if q not in adopted]
        done = []
        for fs, ps in sets.items():
            if len(ps) == len(fs.members) and self._run(fs, hyper, scale, amp):
                done += fs.members
            else:
                rest += ps
        return done, rest

    def _by_kind(self, params: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
        out: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            kind = self.kind(p)
            if kind is not None:
                out.setdefault(kind, []).append(p)
        return out

    def _adoptable(self, p: torch.Tensor, mastered: bool) -> bool:
        """Whether ``p``'s state entry has every key, as tensors of the sizes a set holds."""
        e = dict.get(self.state, p)
        keys = self.records[p].state_keys
        if not e or len(e) != len(keys) + 1 + mastered or "step" not in e:
            return False
        for k in keys + (("master",) if mastered else ()):
            t = e.get(k)
            want = nblocks(p.numel()) if self.rule.blockwise(k) else p.numel()
            if not isinstance(t, torch.Tensor) or t.numel() != want or t.device != p.device:
                return False
        return True

    def _new_set(self, members: list[torch.Tensor], entries: list[dict] | None) -> FlatSet:
        p0 = members[0]
        udt = update_dtype(p0.dtype, self.master_weights)
        keys = self.records[p0].state_keys
        chunk = FLAT_CHUNK.get(p0.device.type, FLAT_CHUNK_DEFAULT)
        mastered = udt != p0.dtype
        draws = (not mastered and p0.dtype == torch.bfloat16) or self.rule.moments == "bf16"
        fs = FlatSet(members, keys, {k: self.rule.key_dtype(k, udt) for k in keys},
                     {k: self.rule.blockwise(k) for k in keys}, mastered=mastered, draws=draws,
                     salts=[self.records[p].salt for p in members], chunk=chunk,
                     entries=entries)  # fmt: skip
        for p in members:
            self.where[p] = fs
        return fs

    def _run(self, fs: FlatSet, hyper: Any, scale, amp) -> bool:
        """One step of set ``fs``; False, with nothing changed, where it cannot run (a grad
        missing or of another dtype, a param no longer contiguous)."""
        grads = []
        for p in fs.members:
            g = p.grad
            if g is None or g.dtype != fs.dtype or g.device != fs.device or not p.is_contiguous():
                return False
            grads.append(g)
        fs.steps.add_(1)  # as the per-tensor path: advanced, then read
        args = None if amp is None else amp.kernel_args(host=False)
        found_inf = None if args is None else args.get("found_inf")
        if found_inf is not None and bool(found_inf.item()):
            # skipped, as torch's fused kernels skip it; the weights get the masters' rounding
            if fs.mastered:
                torch._foreach_copy_(fs.members, fs.master_views)
            fs.steps.sub_(found_inf.to(fs.steps.device))  # a skipped step does not count
            return True
        gs = None if args is None else args.get("grad_scale")
        grad_scale = None if gs is None else float(gs.item())
        lr, beta1, beta2, wd, eps, maximize = hyper_floats(hyper, host=False)
        bf16_master = not fs.mastered and fs.dtype == torch.bfloat16
        moments = MOMENT_CODES[self.rule.moments]
        compressed, cuda_div = bf16_master or moments != 0, fs.device.type == "cuda"
        # the per-tensor scalars exactly as reference.adam_step_flat computes them, once per
        # step count (one for the whole set but after a step some params missed)
        steps = fs.steps.tolist()
        scalars = {s: _step_scalars(lr / (1 - beta1**s), 1 - beta2**s, eps, compressed,
                                    cuda=cuda_div) for s in set(steps)}  # fmt: skip
        uniform = len(scalars) == 1
        if uniform:
            ((neg, d),) = scalars.values()
            fs.fl_cols[0].fill_(neg)
            fs.fl_cols[1].fill_(d)
        else:
            fs.fl_all = fs.per_block([list(scalars[s]) for s in steps])  # (blocks, 2) fp32
        if fs.draws:  # the rounding keys of this step
            keys = key_table(fs.salts, steps[0] if uniform else steps)
            fs.it_keys.copy_(keys.index_select(0, fs.member_of_block()))
        wd_factor = _f32(1 - lr * wd) if wd != 0 and self.rule.decoupled else None
        gsf = None if grad_scale is None else _f32(grad_scale)
        how = device_step_mode(fs.device)  # "eager", "compiled" or "triton"
        if how != "eager":  # tensors: a new lr or loss scale must not recompile the pass
            fs.sc[0].fill_(1.0 if wd_factor is None else wd_factor)  # 0 when lr x wd = 1
            fs.sc[1].fill_(1.0 if gsf is None else gsf)
            wd_factor = None if wd_factor is None else fs.sc[0]
            gsf = None if gsf is None else fs.sc[1]
        kw = dict(wd_factor=wd_factor, grad_scale=gsf, k=_consts(beta1, beta2, wd, eps),
                  maximize=maximize, decoupled=self.rule.decoupled, moments=moments,
                  bf16_master=bf16_master, cuda_div=cuda_div, compressed=compressed)  # fmt: skip
        factors = () if scale is None else scale if isinstance(scale, tuple) else (scale,)
        members = fs.members
        for ps in fs.passes:
            srcs, params = [], []
            for i, a, b, whole in ps.pieces:
                srcs.append(grads[i] if whole else grads[i].reshape(-1)[a:b])
                params.append(members[i] if whole else members[i].view(-1)[a:b])
            torch._foreach_copy_(ps.grads, srcs)
            if not fs.mastered:
                torch._foreach_copy_(ps.weights, params)
            for pads in ps.pads:
                torch._foreach_zero_(pads)
            p_in, g, m, m_sc, v, v_sc, w_out = ps.args
            if factors:  # the clip factors on the grads in the update's dtype, as the
                if fs.mastered:  # per-tensor path multiplies them (fp32 copies for masters)
                    g = g.float()
                for f in factors:
                    g.mul_(f)
                w_out = None  # the weights are then the masters' downcast, as there
            fl = ps.fl if uniform else fs.fl_all[ps.blocks[0] : ps.blocks[1]]
            core_into(p_in, g, m, m_sc, v, v_sc, w_out, fl, ps.it, ps.first_b, how=how, **kw)
            if fs.mastered and w_out is None:
                torch._foreach_copy_(params, ps.masters)
            else:
                torch._foreach_copy_(params, ps.weights)
        return True
