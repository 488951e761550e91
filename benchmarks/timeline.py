"""Where a step's time goes, on one axis: the training thread's marks, the worker's per-bucket
marks and the GPU's events, in ms from the first timed iteration's start (GPU host).

The loop is overlap_bench.py's (``torch.cuda.synchronize()`` before and after each iteration).
Marks: the training thread's iteration start, end of backward, ``step()`` entered and left and
the sync done; the compute stream's end of backward; per bucket the worker's D2H launch, its
update's start and end, its H2D launch, and the GPU's D2H-done and H2D-done events. Prints, per
timed iteration, the phases and the worker's time in the kernel; writes every mark to timeline-MODE-bBATCH.json
(``--replay`` prints the table of one written before).

Usage (GPU host, repo root): python benchmarks/timeline.py --mode delayed --batch-size 16 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from offloadopt import HybridAdamW
from offloadopt.harness import checks, models
from offloadopt.harness.data import get_batch, load_text
from offloadopt.link.pipeline import Pipeline
from offloadopt.link.transfer import Transfer

MODES = {
    "step": {},
    "backward": dict(overlap="backward", wait="module", grads_final=True),
    "delayed": dict(overlap="delayed"),
}


class Marks:
    """Host marks (perf_counter s) and CUDA events, each with a kind and a bucket index."""

    def __init__(self) -> None:
        self.host: list[tuple[str, int, float]] = []
        self.gpu: list[tuple[str, int, object]] = []

    def now(self, kind: str, b: int = -1) -> None:
        self.host.append((kind, b, time.perf_counter()))

    def event(self, kind: str, b: int, ev) -> None:
        if ev is not None:
            self.gpu.append((kind, b, ev))


def instrument(marks: Marks):
    """Wrap the worker's three per-bucket calls so each leaves its marks; returns the function
    that puts the originals back."""
    start_d2h, update, start_h2d = Pipeline._start_d2h, Pipeline._update, Transfer.start_h2d

    def _start_d2h(self, work, stats):
        out = start_d2h(self, work, stats)
        marks.now("d2h_launched", work.bucket.index)
        marks.event("d2h_done", work.bucket.index, out[2])
        return out

    def _update(self, work, tr, slot, d2h_done, fn, stats):
        marks.now("update_start", work.bucket.index)
        update(self, work, tr, slot, d2h_done, fn, stats)
        marks.now("update_end", work.bucket.index)

    def _start_h2d(self, b, idx, slot, weights_free, targets=None):
        start_h2d(self, b, idx, slot, weights_free, targets)
        marks.now("h2d_launched", b.index)
        marks.event("h2d_done", b.index, self.h2d_done.get(b))

    Pipeline._start_d2h, Pipeline._update, Transfer.start_h2d = _start_d2h, _update, _start_h2d

    def undo() -> None:
        Pipeline._start_d2h, Pipeline._update, Transfer.start_h2d = start_d2h, update, start_h2d

    return undo


def summary(rows: list, mode: str, fraction: float, batch_size: int) -> None:
    """Print the per-iteration table of ``rows`` ((kind, bucket, ms), sorted by time)."""
    # Per iteration: the phases, and how much of it the worker spent in the kernel (its updates
    # run one after another, so each start pairs with the next end).
    spans, open_at = [], None
    for k, _, t in rows:
        if k == "update_start":
            open_at = t
        elif k == "update_end" and open_at is not None:
            spans.append((open_at, t))
            open_at = None
    starts = [t for k, _, t in rows if k == "iteration"] + [rows[-1][2]]
    print(f"{mode} f{fraction:g}, batch {batch_size}; ms from each iteration's start")
    print(f"{'iter':>4} {'period':>7} {'bwd ret':>8} {'gpu bwd':>8} {'step in':>8} {'out':>7} "
          f"{'synced':>7} {'kernel':>7} {'not in kernel':>13} {'upd 1st':>7} {'upd end':>7} {'h2d end':>7}")  # fmt: skip
    periods = []
    for n in range(len(starts) - 1):
        t0, t1 = starts[n], starts[n + 1]
        mine = [(k, t - t0) for k, _, t in rows if t0 <= t < t1]

        def first(kind, mine=mine):
            return next((t for k, t in mine if k == kind), float("nan"))

        def last(kind, mine=mine):
            return max((t for k, t in mine if k == kind), default=float("nan"))

        kernel = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in spans)
        whole = first("synced") < t1 - t0 and n + 1 < len(starts) - 1  # a complete iteration
        if whole:
            periods.append(t1 - t0)
        print(f"{n:4d} {t1 - t0 if whole else float('nan'):7.1f} {first('backward_returned'):8.1f} "
              f"{first('backward_done'):8.1f} {first('step_in'):8.1f} {first('step_out'):7.1f} "
              f"{first('synced'):7.1f} {kernel:7.1f} {t1 - t0 - kernel:13.1f} {first('update_start'):7.1f} "
              f"{last('update_end'):7.1f} {last('h2d_done'):7.1f}")  # fmt: skip
    if periods:
        print(
            f"period median {statistics.median(periods):.1f} ms; "
            f"kernel {sum(e - s for s, e in spans):.1f} ms over {len(spans)} bucket updates"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="delayed")
    ap.add_argument("--fraction", type=float, default=1.0, help="the offload fraction, 0..1")
    ap.add_argument("--preset", type=checks.preset, default="gpt2-xl", help="a model preset")
    ap.add_argument("--batch-size", type=checks.positive_int, default=16, help="sequences")
    ap.add_argument("--seq-len", type=checks.positive_int, default=1024, help="tokens")
    ap.add_argument("--warmup", type=checks.nonneg_int, default=3, help="untimed steps")
    ap.add_argument("--steps", type=checks.positive_int, default=4, help="timed steps")
    ap.add_argument("--out", type=checks.out_dir, default="timeline-out")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="the offloaded moments' format (HybridAdamW's state_dtype)")  # fmt: skip
    ap.add_argument("--master-weights", choices=("fp32", "bf16-sr"), default="fp32",
                    help="the offloaded masters' format (HybridAdamW's master_weights)")  # fmt: skip
    ap.add_argument("--bucket-mib", type=checks.positive_int, default=None,
                    help="the buckets' size in MiB (default: HybridAdamW's)")  # fmt: skip
    ap.add_argument(
        "--replay", metavar="JSON", help="print the table of a timeline.json written before"
    )
    args = ap.parse_args(argv)
    if args.replay:
        try:
            meta = json.loads(Path(args.replay).read_text())
            a = meta["args"]
            summary(meta["marks"], a["mode"], a["fraction"], a["batch_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--replay: {args.replay!r} is no timeline.json ({type(e).__name__}: {e})")
        return 0
    try:
        args.device = checks.device(args.device)
    except argparse.ArgumentTypeError as e:
        ap.error(f"argument --device: {e}")
    if not 0.0 <= args.fraction <= 1.0:
        ap.error(f"--fraction: {args.fraction} is not within 0..1")
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def event():  # on the compute stream, or None without CUDA
        if cuda:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return None

    torch.manual_seed(0)
    model = models.build_model(args.preset, device, torch.bfloat16 if cuda else torch.float32)
    loss_fn = models.loss_fn(args.preset)
    gen = torch.Generator().manual_seed(0)
    data = load_text(None)
    batches = [get_batch(data, "train", args.batch_size, args.seq_len, gen, device)
               for _ in range(args.warmup + args.steps)]  # fmt: skip
    masters = True if args.master_weights == "fp32" else args.master_weights
    state = dict(state_dtype=args.state_dtype, master_weights=masters)
    if args.bucket_mib:
        state["bucket_nbytes"] = args.bucket_mib * 2**20
    opt = HybridAdamW(model.parameters(), lr=6e-4, weight_decay=0.1,
                      offload_fraction=args.fraction, **MODES[args.mode], **state)  # fmt: skip
    if MODES[args.mode].get("wait") == "module":
        opt.watch(model)
    marks = Marks()
    undo = instrument(marks)
    ref, t_ref = None, None
    try:
        for i, (x, y) in enumerate(batches):
            sync()
            if i == args.warmup:  # the axis' zero: the GPU is idle, so the event runs at once
                ref = event()
                t_ref = time.perf_counter()
                marks.host.clear()
                marks.gpu.clear()
            marks.now("iteration")
            loss = loss_fn(model, x, y)
            loss.backward()
            marks.now("backward_returned")
            marks.event("backward_done", -1, event())
            marks.now("step_in")
            opt.step()
            marks.now("step_out")
            opt.zero_grad(set_to_none=True)
            sync()
            marks.now("synced")
        opt.synchronize()
        sync()
    finally:
        undo()
    stats = opt.stats  # read once: a read waits for the copies' events
    rows = [(k, b, (t - t_ref) * 1e3) for k, b, t in marks.host]
    rows += [(k, b, ref.elapsed_time(ev)) for k, b, ev in marks.gpu]
    rows.sort(key=lambda r: r[2])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"args": vars(args), "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "none",
            "stats": stats, "marks": rows}  # fmt: skip
    (out / f"timeline-{args.mode}-b{args.batch_size}.json").write_text(json.dumps(meta, indent=1))
    opt.close()
    summary(rows, args.mode, args.fraction, args.batch_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
