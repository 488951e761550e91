"""The overlap modes on the GPU host: a fraction sweep per clipping path, fraction 1 against the
CPU pass and torchao, and peak memory with grad release. One process, one model, the same
initial weights and batches for every configuration; medians of timed iterations (forward,
backward, step, zero_grad) after warm-up, each bracketed by ``torch.cuda.synchronize()``.

Usage (GPU host, repo root): python benchmarks/overlap_bench.py --out $OUT [--quick]
Writes overlap.json after every configuration and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from offloadopt import HybridAdamW
from offloadopt.harness import anchors, checks, models
from offloadopt.harness.data import get_batch, load_text
from offloadopt.harness.probes import time_kernel_under_link
from offloadopt.link.pipeline import StepRun
from offloadopt.place import auto
from offloadopt.step import update

SWEEP = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3]
BEST = dict(overlap="backward", wait="module", grads_final=True)  # nothing edits grads
CLIPPED = dict(overlap="backward", wait="module", max_grad_norm=1.0)  # clipping in the optimizer


# Variants run only when named in --only: what the thread count and bucket size change.
EXTRA = [
    # Backward mode clipped at fraction 0 (nothing offloaded: the same work as "f0 clip") was
    # 12-18 ms slower in a profile: which option, if any, costs it.
    ("backward f0 clip", dict(fraction=0.0, **CLIPPED)),
    ("f0 clip wait-module", dict(fraction=0.0, max_grad_norm=1.0, wait="module")),
    ("backward f0 clip wait-step", dict(fraction=0.0, overlap="backward", max_grad_norm=1.0)),
    # Without fp32 masters (bf16 params, bf16 moments: torchao's CPUOffloadOptimizer's math,
    # half the CPU kernel's bytes); their bound uses the bf16 kernel probe.
    ("step f1 bf16", dict(fraction=1.0, master_weights=False)),
    ("backward f1 bf16", dict(fraction=1.0, master_weights=False, **BEST)),
    ("delayed f1 bf16", dict(fraction=1.0, master_weights=False, overlap="delayed")),
    ("backward f1 threads16", dict(fraction=1.0, cpu_threads=16, **BEST)),
    ("backward f1 bucket256", dict(fraction=1.0, bucket_nbytes=256 * 2**20, **BEST)),
    ("backward f0.2 threads16", dict(fraction=0.2, cpu_threads=16, **BEST)),
    ("backward f0.2 bucket16", dict(fraction=0.2, bucket_nbytes=16 * 2**20, **BEST)),
    # The delayed update's worker takes the GIL back between buckets while the training thread
    # launches the next forward and backward: fewer buckets, or a shorter switch interval.
    ("delayed f1 bucket256", dict(fraction=1.0, overlap="delayed", bucket_nbytes=256 * 2**20)),
    ("delayed f1 bucket1024", dict(fraction=1.0, overlap="delayed", bucket_nbytes=2**30)),
    ("delayed f1 switch1ms", dict(fraction=1.0, overlap="delayed", switch_s=1e-3)),
    # set_offload_fraction between steps, as auto does, without auto's probe: is a moved
    # placement as fast as one made at construction?
    ("backward f0.5 moved to f0.15", dict(fraction=0.5, move_at=4, move_to=0.15, **BEST)),
    (
        "delayed f1 bucket256 switch1ms",
        dict(fraction=1.0, overlap="delayed", bucket_nbytes=256 * 2**20, switch_s=1e-3),
    ),
]


def derived(name: str, known: dict[str, dict]) -> dict:
    """The configuration called ``name``: a known one, or a known one followed by variants,
    each a word: ``threadsN`` (cpu_threads=N), ``bucketN`` (N MiB buckets), ``switchN``
    (sys.setswitchinterval of N ms), ``fifo`` (the worker takes queued buckets in the order
    they were fed, as before pipeline.StepRun took the forward's first), ``perseg`` (one
    kernel operand per segment, as before update._joined joined back-to-back ones), ``base``
    (HybridAdamW of the baseline package ``offloadopt_base`` under ``--baseline-dir``),
    ``int8`` / ``sr8`` (compressed state: :data:`STATES`), ``spec`` (``speculate=True``),
    ``maxnormN`` (``max_grad_norm=N``), ``copybk`` (with ``spec``: the backup as a copy before
    the update, not the CPU kernel's, as before 2026-12-04), ``nohold`` (with ``spec``: every
    step speculates, none held back after a redo or a clipped step: a redo forced while the
    norm is over the limit), ``pertensor`` (the device-resident
    compressed update per tensor, ``OFFLOADOPT_DEVICE_FLAT=0``, as before the flat buffers of
    2026-12-07), ``oneworker`` (no update thread: the worker runs each update between its copy
    launches, the default: ``OFFLOADOPT_UPDATE_THREAD=never``), ``updthread`` (the
    update thread: each update runs there while the worker launches the copies), e.g.
    "backward f0.2 threads8 switch1"; "backward f0 int8" is issue 46's
    fraction 0 in backward mode. Raises ValueError for a name that is none of these."""
    if name in known:
        return known[name]
    fixed = re.fullmatch(r"(backward|delayed) f(0|0?\.\d+|1)( clip)?", name)
    if fixed:  # a fraction off the sweep's grid: "backward f0.4", "backward f0.45 clip"
        mode, f, clip = fixed.groups()
        if mode == "delayed":
            return dict(
                fraction=float(f), overlap="delayed", **({"max_grad_norm": 1.0} if clip else {})
            )
        return dict(fraction=float(f), **(CLIPPED if clip else BEST))
    base, _, last = name.rpartition(" ")
    if base and last == "fifo":  # the worker takes queued buckets in feed order (before 2026-12-01)
        return {**derived(base, known), "fifo": True}
    if base and last == "perseg":  # one kernel operand per segment (before 2026-12-02)
        return {**derived(base, known), "perseg": True}
    if base and last == "base":  # the baseline package (gpu_run.sh's "ab" says how it is made)
        return {**derived(base, known), "base": True}
    if base and last in STATES:  # a compressed representation (docs/compressed-state.md)
        return {**derived(base, known), **STATES[last]}
    if base and last == "spec":  # speculative updates (offloadopt/step/speculate.py)
        return {**derived(base, known), "speculate": True}
    if base and last == "copybk":  # speculation's backup copied before the update
        return {**derived(base, known), "copy_backup": True}
    if base and last == "nohold":  # every step speculates (no holding back: MAX_HOLD 0)
        return {**derived(base, known), "no_hold": True}
    if base and last == "pertensor":  # the device update per tensor (before 2026-12-07)
        return {**derived(base, known), "per_tensor": True}
    if base and last == "oneworker":  # no update thread (the default)
        return {**derived(base, known), "update_thread": "never"}
    if base and last == "updthread":  # the update thread (OFFLOADOPT_UPDATE_THREAD=link)
        return {**derived(base, known), "update_thread": "link"}
    for prefix, key, unit in (("threads", "cpu_threads", 1), ("bucket", "bucket_nbytes", 2**20),
                              ("switch", "switch_s", 1e-3), ("maxnorm", "max_grad_norm", 1.0)):  # fmt: skip
        if base and last.startswith(prefix) and last[len(prefix) :].replace(".", "", 1).isdigit():
            value = float(last[len(prefix) :]) * unit
            value = value if key in ("switch_s", "max_grad_norm") else int(value)
            if value <= 0:  # a thread count, a size, an interval: each above 0
                raise ValueError(f"--only: {name!r}: {last!r} needs a number above 0")
            return {**derived(base, known), key: value}
    raise ValueError(f"--only: {name!r} is no configuration, nor one followed by variant words "
                     "(threadsN, bucketN, switchN, maxnormN, fifo, perseg, base, int8, sr8, spec, copybk, nohold, pertensor, oneworker, updthread); --help lists the names")  # fmt: skip


# Variant words for compressed optimizer state: "int8" (int8 moments, fp32 masters) and "sr8"
# (int8 moments, bf16 masters rounded stochastically), e.g. "backward f0.3 int8".
STATES = {"int8": dict(state_dtype="int8"),
          "sr8": dict(state_dtype="int8", master_weights="bf16-sr")}  # fmt: skip


# offload_fraction="auto" needs its probe, baseline, verify and steady steps (each correction's
# too) before the timed ones; after a move, the settling steps are no sample.
_MOVED = 1 + auto.SETTLE_STEPS + auto.MEASURED_STEPS
AUTO_WARMUP = (1 + auto.MEASURED_STEPS + _MOVED
               + (1 + auto.CORRECTIONS) * (_MOVED + auto.STEADY_AFTER + auto.MEASURED_STEPS))  # fmt: skip


def configs(quick: bool) -> list[tuple[str, dict]]:
    sweep = SWEEP[1::2] if quick else SWEEP
    out = [("f0", dict(fraction=0.0))]
    out += [(f"backward f{f:g}", dict(fraction=f, **BEST)) for f in sweep]
    # issue 14: auto against the sweep above; with a budget, the peak of "backward f0.2"
    out += [("backward auto", dict(fraction="auto", **BEST)),
            ("backward auto budget", dict(fraction="auto", budget_of="backward f0.2", **BEST))]  # fmt: skip
    out += [(f"step f{f:g}", dict(fraction=f)) for f in (0.1, 0.2)]
    out += [("f0 clip", dict(fraction=0.0, max_grad_norm=1.0))]
    out += [(f"backward f{f:g} clip", dict(fraction=f, **CLIPPED)) for f in sweep]
    out += [("f0 torch-clip", dict(fraction=0.0, torch_clip=True))]
    out += [(f"backward f{f:g} torch-clip", dict(fraction=f, overlap="backward", torch_clip=True))
            for f in (0.05, 0.1, 0.2)]  # fmt: skip
    out += [("step f1", dict(fraction=1.0)), ("backward f1", dict(fraction=1.0, **BEST)),
            ("backward f1 clip", dict(fraction=1.0, **CLIPPED)), ("torchao", dict(torchao=True))]  # fmt: skip
    # The delayed parameter update (issue 9's figures: run with --batch-size 16).
    out += [("delayed f1", dict(fraction=1.0, overlap="delayed")),
            ("delayed f1 clip", dict(fraction=1.0, overlap="delayed", max_grad_norm=1.0)),
            ("delayed f1 torch-clip", dict(fraction=1.0, overlap="delayed", torch_clip=True))]  # fmt: skip
    return out


def selected(only: list[str] | None, quick: bool) -> list[tuple[str, dict]]:
    """Every configuration (``quick``: half the sweep), or those ``only`` names (``derived``)."""
    if only is None:
        return configs(quick) + EXTRA
    known = dict(configs(False) + EXTRA)
    return [(name, derived(name, known)) for name in only]


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def run(model, init, batches, name, cfg, warmup, steps, lr=6e-4):
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loss_fn = models.loss_fn("gpt2-xl")
    cfg = dict(cfg)
    torch_clip, torchao = cfg.pop("torch_clip", False), cfg.pop("torchao", False)
    switch_s, before_switch = cfg.pop("switch_s", None), sys.getswitchinterval()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)
    fraction = cfg.pop("fraction", 1.0)
    if cfg.pop("fifo", False):  # main() puts the method back after each configuration
        StepRun._take = lambda run: run._queue.popleft()
    if cfg.pop("perseg", False):  # main() puts the function back after each configuration
        update._joined = lambda segs, columns, steps: (columns, steps)
    if "update_thread" in cfg:  # main() puts the setting back after each configuration
        os.environ["OFFLOADOPT_UPDATE_THREAD"] = cfg.pop("update_thread")  # read at start_worker
    if cfg.pop("per_tensor", False):  # main() puts the variable back after each configuration
        os.environ["OFFLOADOPT_DEVICE_FLAT"] = "0"  # (step/device_flat.py reads it per step)
    hybrid = HybridAdamW
    if cfg.pop("base", False):
        hybrid = importlib.import_module("offloadopt_base").HybridAdamW
    move_at, move_to = cfg.pop("move_at", None), cfg.pop("move_to", None)
    copy_backup, no_hold = cfg.pop("copy_backup", False), cfg.pop("no_hold", False)
    if fraction == "auto" or move_at is not None:
        warmup = max(warmup, AUTO_WARMUP)
    t = time.perf_counter()
    if torchao:
        opt = anchors.torchao_offload(model, lr)["opt"]
    else:
        opt = hybrid(model.parameters(), lr=lr, weight_decay=0.1, offload_fraction=fraction, **cfg)  # fmt: skip
        if copy_backup:
            opt.debug.speculation.kernel_backup = False
        if no_hold:
            opt.debug.speculation.MAX_HOLD = 0
        if cfg.get("wait") == "module":
            opt.watch(model)
    build_s = time.perf_counter() - t
    times, fb = [], []
    # The baseline's forward+backward (GPU work included) needs a sync before step(), which
    # would also keep step()'s launches from overlapping backward: it is timed in extra
    # iterations after the timed ones, never in them (the step times of f0 had that sync
    # before 2026-12-02, which favoured every fraction against it).
    plan = list(enumerate(batches[: warmup + steps]))
    if name == "f0":
        plan += [(None, batch) for batch in batches[warmup : warmup + steps]]
    for i, (x, y) in plan:
        sync(model)
        t0 = time.perf_counter()
        loss = loss_fn(model, x, y)
        loss.backward()
        if i is None:
            sync(model)
            fb.append((time.perf_counter() - t0) * 1e3)
        t1 = time.perf_counter()
        if torch_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i is not None and i == move_at:
            opt.set_offload_fraction(move_to)
        sync(model)
        t2 = time.perf_counter()
        if i is not None and i >= warmup:
            times.append((t2 - t0) * 1e3)
            if name != "f0":
                fb.append((t1 - t0) * 1e3)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    r = {
        "name": name, "fraction": getattr(opt, "offload_fraction", fraction),
        "choice": getattr(opt, "placement_choice", None), "step_ms": statistics.median(times),
        "step_ms_min": min(times), "step_ms_max": max(times),
        "to_backward_end_ms": statistics.median(fb),
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
        "build_s": build_s,
        "loss": float(loss.detach()), "stats": dict(getattr(opt, "stats", {})),
        "speculation": getattr(opt, "speculation", None),
        "grad_norm": float(opt.last_grad_norm) if getattr(opt, "last_grad_norm", None) is not None else None,
    }  # fmt: skip
    if hasattr(opt, "close"):
        opt.close()
    sys.setswitchinterval(before_switch)
    del opt
    gc.collect()
    return r


def memory_runs(preset, device, data, warmup, steps):
    """Fraction 1, activation checkpointing, batch 1 x 1024: step mode against grad release."""
    torch.manual_seed(0)
    model = models.build_model(preset, device, torch.bfloat16)
    model.checkpointing = True
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    seq = min(1024, model.cfg.block_size)
    batches = [get_batch(data, "train", 1, seq, gen, device) for _ in range(warmup + steps)]
    out = []
    for name, cfg in (("ckpt b1 step f1", dict(fraction=1.0)),
                      ("ckpt b1 backward f1 release", dict(fraction=1.0, release_grads=True, **BEST)),
                      ("ckpt b1 backward f1 clip release", dict(fraction=1.0, release_grads=True, **CLIPPED))):  # fmt: skip
        out.append(run(model, init, batches, name, cfg, warmup, steps))
        print(f"{name:34} step {out[-1]['step_ms']:7.1f} ms  peak {out[-1]['peak_gpu_gb']:6.2f} GB", flush=True)  # fmt: skip
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before anything is loaded or built: a bad value is argparse's
    usage error (status 2) naming the flag and the value."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", type=checks.preset, default="gpt2-xl", help="a model preset")
    ap.add_argument("--batch-size", type=checks.positive_int, default=4, help="sequences, >= 1")
    ap.add_argument("--seq-len", type=checks.positive_int, default=None,
                    help="tokens, >= 1 (default 1024, or the preset's longest if shorter)")  # fmt: skip
    ap.add_argument("--warmup", type=checks.nonneg_int, default=3, help="untimed steps, >= 0")
    ap.add_argument("--steps", type=checks.positive_int, default=6, help="timed steps, >= 1")
    ap.add_argument("--quick", action="store_true", help="half the sweep")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help=(
        "run only these configurations, each one quoted argument: a configuration's name, "
        "optionally followed by variant words: threadsN (cpu_threads=N), bucketN (N MiB buckets), "
        "switchN (sys.setswitchinterval of N ms), fifo (the worker takes queued buckets in feed "
        "order), perseg (one kernel operand per segment), base (the baseline package under "
        "--baseline-dir), oneworker (no update thread), updthread (the update thread), int8, sr8, spec; e.g. --only f0 'backward f0.2 threads8 switch1' 'delayed f1 bucket256 fifo'. "
        "Names: " + ", ".join(repr(n) for n, _ in configs(False) + EXTRA)))  # fmt: skip
    ap.add_argument("--no-probe", action="store_true", help="skip the kernel probe")
    ap.add_argument("--baseline-dir", default=".baseline", help=(
        "where the 'base' variant imports offloadopt_base from (benchmarks/gpu_run.sh's ab "
        "part says how to make it)"))  # fmt: skip
    ap.add_argument("--no-memory", action="store_true", help="skip the grad-release memory runs")
    ap.add_argument("--list", action="store_true", help=(
        "print each selected configuration's name and options (one JSON line each) and exit"))  # fmt: skip
    ap.add_argument("--summary", metavar="OVERLAP_JSON", default=None,
                    help="print the findings of a saved overlap.json and exit")  # fmt: skip
    ap.add_argument("--out", type=checks.out_dir, default="overlap-out")
    ap.add_argument("--device", type=checks.device, default="cuda", help="cpu: a smoke test")
    args = ap.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = min(1024, models.max_seq_len(args.preset))
    if args.seq_len > (longest := models.max_seq_len(args.preset)):
        ap.error(f"--seq-len: {args.seq_len} is more than the {args.preset} preset's {longest}")
    try:
        selected(args.only, args.quick)
    except ValueError as e:
        ap.error(str(e))
    base = Path(args.baseline_dir) / "offloadopt_base" / "__init__.py"
    if any(name.endswith(" base") for name in args.only or ()) and not base.is_file():
        ap.error(f"--baseline-dir: {args.baseline_dir!r} holds no offloadopt_base package "
                 "(benchmarks/gpu_run.sh's ab part says how to make one)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, cfg in selected(args.only, args.quick):
            print(json.dumps({"name": name, "options": cfg}))
        return 0
    if args.summary:
        results = json.loads(Path(args.summary).read_text())
        summarize(results, results["params"])
        return 0
    if any(name.endswith(" base") for name in args.only or ()):
        sys.path.insert(0, str(Path(args.baseline_dir).resolve()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    data = load_text(None)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none"
    results: dict = {"args": vars(args), "torch": torch.__version__, "gpu": gpu}

    def write() -> None:
        (out / "overlap.json").write_text(json.dumps(results, indent=1, default=str))

    torch.manual_seed(0)
    model = models.build_model(args.preset, device, torch.bfloat16)
    n = models.num_params(model)
    # On the host: a copy on the GPU would count in every configuration's peak memory.
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    batches = [get_batch(data, "train", args.batch_size, args.seq_len, gen, device)
               for _ in range(max(args.warmup, AUTO_WARMUP) + args.steps)]  # fmt: skip
    results["params"] = n
    rows = results["configs"] = []
    take, joined = StepRun._take, update._joined
    # the variables a "pertensor", "oneworker" or "updthread" variant sets
    env = {k: os.environ.get(k) for k in ("OFFLOADOPT_DEVICE_FLAT", "OFFLOADOPT_UPDATE_THREAD")}
    for name, cfg in selected(args.only, args.quick):
        try:
            if "budget_of" in cfg:  # a budget of a measured row's peak: fractions above it fit
                cfg = dict(cfg)
                of_name = cfg.pop("budget_of")
                of = next(r for r in rows if r["name"] == of_name and "error" not in r)
                if device.type != "cuda":
                    raise anchors.Unavailable("a GPU budget needs a GPU's measured peak")
                cfg["max_gpu_memory"] = int(of["peak_gpu_gb"] * 1e9)
            try:
                rows.append(run(model, init, batches, name, cfg, args.warmup, args.steps))
            finally:
                StepRun._take = take  # a "fifo" variant replaced it
                update._joined = joined  # a "perseg" variant replaced it
                for k, v in env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        except anchors.Unavailable as e:
            rows.append({"name": name, "error": f"skipped: {e}"})
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the rest
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"[:400]})
        r = rows[-1]
        print(f"{name:28} " + (f"step {r['step_ms']:7.1f} ms (min {r['step_ms_min']:.1f})  to end "
              f"of backward {r['to_backward_end_ms']:6.1f}  peak {r['peak_gpu_gb']:6.2f} GB"
              + (f"  norm {r['grad_norm']:.3g}" if r.get("grad_norm") is not None else "")
              + (f"  redone {r['speculation']['redone_clip'] + r['speculation']['redone_inf']}"
                 f"/{r['speculation']['steps']}" if r.get("speculation") else "")
              if "error" not in r else r["error"]), flush=True)  # fmt: skip
        write()
    # The CPU pass as the offloaded step sees it: a quarter of the params, scaled up.
    del model
    gc.collect()
    if device.type == "cuda" and not args.no_probe:
        torch.cuda.empty_cache()
        probe = time_kernel_under_link(device, n // 4, (4 * n) // 4)
        results["kernel_probe"] = probe
        write()
        if any("bf16" in r["name"] for r in rows):  # bf16 params: 2 bytes a param each way
            results["kernel_probe_bf16"] = time_kernel_under_link(
                device, n // 4, (2 * n) // 4, dtype=torch.bfloat16
            )
            write()
    if device.type == "cuda" and not args.no_memory:
        results["memory"] = memory_runs(args.preset, device, data, 2, 3)
        write()
    summarize(results, n)
    failed = [r["name"] for r in rows if "error" in r and not r["error"].startswith("skipped:")]
    if failed:  # the rows are written; the exit status says some are missing
        print(f"overlap_bench.py: {len(failed)} configuration(s) failed: {', '.join(failed)}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _f(x: float | None, spec: str) -> str:
    """``x`` in ``spec``, or n/a for a figure that is missing (None or nan: a row not run)."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def summarize(results: dict, n: int) -> None:
    """The findings; a figure of a missing row (--only, failed, --no-probe) reads n/a."""
    rows = {r["name"]: r for r in results["configs"] if "error" not in r}
    probe = results.get("kernel_probe", {})
    print(f"\n{results['gpu']}, torch {results['torch']}, {n / 1e9:.2f}e9 params, batch "
          f"{results['args']['batch_size']}x{results['args']['seq_len']}; medians")  # fmt: skip
    for base, suffix in (("f0", ""), ("f0 clip", " clip"), ("f0 torch-clip", " torch-clip")):
        if base not in rows:
            continue
        b = rows[base]["step_ms"]
        best, within, line = 0.0, True, []
        for f in SWEEP:
            r = rows.get(f"backward f{f:g}{suffix}")
            if r is None:
                continue
            ratio = r["step_ms"] / b
            line.append(f"{f:g}:{ratio:.2f}x")
            within = within and ratio <= 1.10
            if within:
                best = f
        print(f"  sweep{suffix or ' (no clipping)'}: {base} {b:.1f} ms; {' '.join(line) or 'n/a'}; "
              f"largest within 1.10x: {f'{best:g}' if line else 'n/a'}")  # fmt: skip
    summarize_auto(rows, results)
    kernel_ms = probe.get("worker_link_ns_per_param", math.nan) * n / 1e6
    fb = rows.get("f0", {}).get("to_backward_end_ms", math.nan)
    # the bound needs both figures: against one alone the ratio would mean nothing
    bound = max(fb, kernel_ms) if math.isfinite(fb) and math.isfinite(kernel_ms) else math.nan
    for name in ("step f1", "backward f1", "backward f1 clip", "torchao", "delayed f1",
                 "delayed f1 clip", "delayed f1 torch-clip"):  # fmt: skip
        if name in rows:
            print(f"  {name:18} {rows[name]['step_ms']:7.1f} ms; / max(fwd+bwd {_f(fb, '.0f')}, CPU "
                  f"pass {_f(kernel_ms, '.0f')}) = {_f(rows[name]['step_ms'] / bound, '.2f')}")  # fmt: skip
    probe16 = results.get("kernel_probe_bf16", {})
    kernel16_ms = probe16.get("worker_link_ns_per_param", math.nan) * n / 1e6
    bound16 = max(fb, kernel16_ms) if math.isfinite(fb) and math.isfinite(kernel16_ms) else math.nan
    for name in ("step f1 bf16", "backward f1 bf16", "delayed f1 bf16"):
        if name in rows:
            print(f"  {name:18} {rows[name]['step_ms']:7.1f} ms; / max(fwd+bwd {_f(fb, '.0f')}, bf16 CPU "
                  f"pass {_f(kernel16_ms, '.0f')}) = {_f(rows[name]['step_ms'] / bound16, '.2f')}")  # fmt: skip
    if probe:
        print(f"  CPU pass, ns/param: main {probe['main_alone_ns_per_param']:.3f} alone, "
              f"{probe['main_link_ns_per_param']:.3f} with link; worker {probe['worker_alone_ns_per_param']:.3f}, "
              f"{probe['worker_link_ns_per_param']:.3f}")  # fmt: skip
    mem = {r["name"]: r for r in results.get("memory", [])}
    if "ckpt b1 step f1" in mem and "ckpt b1 backward f1 release" in mem:
        a, b = mem["ckpt b1 step f1"]["peak_gpu_gb"], mem["ckpt b1 backward f1 release"]["peak_gpu_gb"]  # fmt: skip
        print(f"  peak GPU, ckpt batch 1, f1: step {a:.2f} GB, release {b:.2f} GB ({b / a:.2f}x)")


def summarize_auto(rows: dict, results: dict) -> None:
    """issue 14's figures: auto against the sweep, the budget's choice against the fixed
    fractions that fit, and the cost model's predicted sweep against the measured one."""
    base, a = rows.get("f0"), rows.get("backward auto")
    if base is None or a is None:
        return
    b = base["step_ms"]
    measured = {0.0: b} | {f: rows[f"backward f{f:g}"]["step_ms"] for f in SWEEP
                           if f"backward f{f:g}" in rows}  # fmt: skip
    within = [f for f in measured if measured[f] <= 1.05 * b and all(
        measured[g] <= 1.05 * b for g in measured if g <= f)]  # fmt: skip
    choice = a.get("choice") or {}
    moves = " -> ".join(f"{c['fraction']:g} ({c['measured_step_ms']:.1f} ms)"
                        for c in choice.get("corrections", []))  # fmt: skip
    print(f"  auto: chose {a['fraction']:g}{' after ' + moves if moves else ''}, step "
          f"{a['step_ms']:.1f} ms = {a['step_ms'] / b:.3f} x f0; largest sweep fraction within "
          f"1.05x: {max(within):g}")  # fmt: skip
    predicted = choice.get("predicted_sweep_ms", {})
    errors = {
        f: predicted[round(f, 2)] / ms - 1 for f, ms in measured.items() if round(f, 2) in predicted
    }
    if "backward f1" in rows and 1.0 in predicted:
        errors[1.0] = predicted[1.0] / rows["backward f1"]["step_ms"] - 1
    results["auto_model_errors"] = errors
    print("  cost model from auto's probe, predicted/measured - 1: "
          + (" ".join(f"{f:g}:{e:+.1%}" for f, e in sorted(errors.items())) or "n/a"))  # fmt: skip
    bud = rows.get("backward auto budget")
    if bud is not None:
        limit = bud["choice"]["max_gpu_memory"] / 1e9
        fits = {r["fraction"]: r["step_ms"] for r in rows.values() if r["name"].startswith("backward f")
                and not r["name"].endswith(("clip", "torch-clip")) and r["peak_gpu_gb"] <= limit}  # fmt: skip
        best = min(fits, key=fits.get) if fits else math.nan
        best_ms = fits.get(best, math.nan)
        print(f"  auto with max_gpu_memory {limit:.2f} GB: chose {bud['fraction']:g}, peak "
              f"{bud['peak_gpu_gb']:.2f} GB, step {bud['step_ms']:.1f} ms = {_f(bud['step_ms'] / best_ms, '.3f')} x "
              f"the best fixed fraction that fits ({_f(best, 'g')}: {_f(best_ms, '.1f')} ms)")  # fmt: skip
    plot_auto(measured, predicted, rows, results)


def plot_auto(measured: dict, predicted: dict, rows: dict, results: dict) -> None:
    """auto-predicted.png beside overlap.json: the cost model's sweep (from auto's probe)
    against the measured one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    out = Path(results["args"]["out"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(predicted)
    ax.plot(xs, [predicted[x] for x in xs], "-", label="predicted (auto's probe at 0.5)")
    pts = dict(measured)
    if "backward f1" in rows:
        pts[1.0] = rows["backward f1"]["step_ms"]
    ax.plot(sorted(pts), [pts[x] for x in sorted(pts)], "o", label="measured")
    a = rows["backward auto"]
    ax.plot([a["fraction"]], [a["step_ms"]], "*", markersize=14, label=f"auto's choice ({a['fraction']:g})")  # fmt: skip
    ax.set_xlabel("offload fraction")
    ax.set_ylabel("step (ms)")
    ax.set_title(f"{results['gpu']}, backward mode, grads final")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "auto-predicted.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
