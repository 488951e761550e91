"""Side-by-side benchmark: HybridAdamW at several fractions and the anchors, one process.

Every configuration trains the same model from the same initial weights on the same batches:
warm-up steps, then timed steps bracketed by ``torch.cuda.synchronize()``; medians reported.
Baseline: HybridAdamW at fraction 0 (fp32 masters and moments on the GPU, torch's fused CUDA
AdamW). bench.partial.json is written after each configuration, so a cut-short run keeps what
it measured, and bench.json only when the run ends (a cut-short run leaves a previous one's);
every file is written whole (a temporary name, then a rename), and the ``--out`` folder is made
only when the first one is.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from offloadopt.harness import anchors, checks, models, provenance
from offloadopt.harness.bench_options import BENCH_FIELD_CHECKS as FIELD_CHECKS  # noqa: F401 - its old home
from offloadopt.harness.bench_options import BenchConfig
from offloadopt.harness.checks import UsageError
from offloadopt.harness.data import get_batch, mock_data
from offloadopt.harness.distributed import Dist, init_from_env, merge_ranks, teardown
from offloadopt.harness.options import resolve_device
from offloadopt.harness.probes import time_compressed_kernel, time_kernel, time_link
from offloadopt.harness.report import format_table, plot, sweep_summary
from offloadopt.harness.train import host_rss_nbytes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # options.DTYPE_NAMES' dtypes
# HybridAdamW's weights must match the baseline's within the run-to-run variation of training
# itself: backward on the GPU is not deterministic (flash attention accumulates with atomics),
# and AdamW turns the tiny grad differences of near-zero grads into lr-sized moves. The
# benchmark measures that floor by running the baseline twice; a configuration drifts when its
# RMS relative difference exceeds DRIFT_FACTOR x that floor.
DRIFT_FACTOR = 3.0


def resolved(cfg: BenchConfig) -> BenchConfig:
    """A checked copy of ``cfg`` with ``seq_len`` filled in; nothing is built or written.

    Raises ``UsageError`` (a ValueError) naming the ``--flag``: a value out of range
    (``FIELD_CHECKS``), an unknown preset, dtype or anchor, ``seq_len`` beyond the preset's
    positions, an ``hf-*`` preset without transformers.
    """
    for flag, value, known in (("--preset", cfg.preset, models.MODEL_PRESETS),
                               ("--dtype", cfg.dtype, DTYPES),
                               *(("--overlap", m, anchors.MODES) for m in cfg.modes),
                               *(("--anchors", a, anchors.ANCHORS) for a in cfg.anchors)):  # fmt: skip
        if value not in known:
            raise UsageError(f"{flag}: {value!r} is not one of {', '.join(known)}")
    if missing := models.missing_package(cfg.preset):
        raise UsageError(f"--preset: {cfg.preset!r} needs {missing} (pip install {missing})")
    if not cfg.fractions:
        raise UsageError("--fractions: none given")
    checked = {k: checks.check(f"--{k.replace('_', '-')}", getattr(cfg, k), f)
               for k, f in FIELD_CHECKS.items() if getattr(cfg, k) is not None}  # fmt: skip
    fractions = [checks.check("--fractions", f, checks.fraction) for f in cfg.fractions]
    longest = models.max_seq_len(cfg.preset)
    seq_len = checked.setdefault("seq_len", min(longest, 1024))
    if seq_len > longest:
        raise UsageError(f"--seq-len: {seq_len} is more than the {cfg.preset} preset's {longest}")
    return replace(cfg, **checked, fractions=fractions, anchors=list(cfg.anchors),
                   modes=list(dict.fromkeys(cfg.modes)))  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_caches(device: torch.device) -> None:
    gc.collect()
    try:  # give freed heap memory back to the OS, so RSS figures are per configuration
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        empty_host = empty_host or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()  # the pinned blocks an anchor left in torch's caching host allocator


def _pinned_nbytes(opt: Any) -> int:
    """Pinned host bytes: the optimizer's own count, else torch's caching host allocator's."""
    if hasattr(opt, "pinned_nbytes"):
        return int(opt.pinned_nbytes)
    try:
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.current", stats.get("allocation.current", 0)))
    except Exception:  # noqa: BLE001 - older torch: unknown
        return 0


class Bench:
    """Holds the model, its initial weights and the batches shared by every configuration."""

    def __init__(self, cfg: BenchConfig):
        """Raises ``UsageError`` for a bad ``cfg`` (see :func:`resolved`) or data file."""
        self.cfg = cfg = resolved(cfg)
        self.device = torch.device(cfg.device)
        # the text before the model: a missing or short file fails at once, not after a build
        text = None if cfg.mock_data else checks.text_data(cfg.data, cfg.seq_len)
        torch.manual_seed(cfg.seed)
        self.model = models.build_model(cfg.preset, self.device, DTYPES[cfg.dtype])
        self.loss = models.loss_fn(cfg.preset)  # loss(model, x, y), the model or a wrapper of it
        self.init = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        data = text if text is not None else mock_data(models.vocab_size(self.model))
        self.data = data
        gen = torch.Generator().manual_seed(cfg.seed)
        n = cfg.warmup + max(cfg.steps, cfg.slow_steps)
        self.batches = [
            get_batch(data, "train", cfg.batch_size, cfg.seq_len, gen, self.device)
            for _ in range(n)
        ]
        self.baseline: dict[int, dict[str, torch.Tensor]] = {}  # steps taken -> weights
        self.noise_floor: float | None = None  # RMS relative difference of two baseline runs

    def reset_model(self) -> torch.nn.Module:
        self.model.to(self.device)  # back from the host if the last configuration parked it
        self.model.load_state_dict(self.init)
        self.model.zero_grad(set_to_none=True)
        return self.model

    def run(self, name: str, build, slow: bool = False) -> dict[str, Any]:
        """Build one configuration, warm it up, time it, audit it, check its weights.

        ``build(model, lr)`` (also ``batch_size=`` when it takes that keyword) returns the
        dict anchors.py describes. A configuration that trains its own copy of the model gets
        the shared one parked on the host meanwhile, so the shared weights do not count in its
        peak GPU memory; its host figures then include them (``parked_gb``).
        """
        cfg, device = self.cfg, self.device
        _empty_caches(device)
        rss_before = host_rss_nbytes()
        t = time.perf_counter()
        sized = "batch_size" in inspect.signature(build).parameters
        built = build(
            self.reset_model(), cfg.lr, **({"batch_size": cfg.batch_size} if sized else {})
        )
        model, opt, step_fn = built.get("model", self.model), built["opt"], built.get("step")
        forward = built.get("loss", self.loss)
        backward = built.get("backward", lambda loss: loss.backward())
        weights = built.get("weights", self._weights)
        if step_fn is None:

            def step_fn(o=opt) -> None:
                o.step()
                o.zero_grad(set_to_none=True)

        construct_s = time.perf_counter() - t
        shared = [*self.model.parameters(), *self.model.buffers()]
        parked_nbytes = 0
        if device.type == "cuda" and not {id(p) for p in model.parameters()} & set(map(id, shared)):
            parked_nbytes = sum(v.nbytes for v in shared)
            self.model.to("cpu")  # reset_model brings it back
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fb, total, stats = [], [], []
        timed = cfg.slow_steps if slow else cfg.steps
        loss = None
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        for i, (x, y) in enumerate(self.batches[: cfg.warmup + timed]):
            _sync(device)
            t0 = time.perf_counter()
            loss = forward(model, x, y)
            backward(loss)
            _sync(device)
            t1 = time.perf_counter()
            step_fn()
            _sync(device)
            t2 = time.perf_counter()
            if i >= cfg.warmup:
                fb.append((t1 - t0) * 1e3)
                total.append((t2 - t0) * 1e3)
                if hasattr(opt, "stats"):
                    stats.append(opt.stats)
            if built.get("baseline") and i + 1 == cfg.warmup + cfg.slow_steps:
                snapshots[i + 1] = weights(model)  # to check the slow anchors against
        result: dict[str, Any] = {
            "name": name, "kind": built.get("kind", "hybrid"), "fraction": built.get("fraction"),
            "mode": built.get("mode", "step"),
            "numerics": built.get("numerics", "same"), "construct_s": construct_s,
            "step_ms": statistics.median(total), "step_ms_min": min(total), "step_ms_max": max(total),
            # an optimizer that updates every k-th step (ZenFlow) has a median that hides them
            "step_ms_mean": statistics.fmean(total),
            "fwd_bwd_ms": statistics.median(fb),
            "opt_ms": statistics.median(t - f for t, f in zip(total, fb, strict=True)),
            "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
            "host_rss_gb": host_rss_nbytes() / 1e9, "host_added_gb": (host_rss_nbytes() - rss_before) / 1e9,
            "pinned_gb": _pinned_nbytes(opt) / 1e9, "opt_host_gb": getattr(opt, "host_nbytes", 0) / 1e9,
            "parked_gb": parked_nbytes / 1e9,
            "loss": float(loss.detach()), "timed_steps": len(total),
        }  # fmt: skip
        for key, last in stats[-1].items() if stats else ():
            # numbers: the median over the timed steps; text (the worker's CPUs): the last
            result[f"opt_stats_{key}"] = (last if isinstance(last, str)
                                          else statistics.median(s[key] for s in stats))  # fmt: skip
        steps_taken = cfg.warmup + timed
        if built.get("baseline"):
            self.baseline = {**snapshots, steps_taken: weights(model)}
            result["status"] = "baseline"
        else:
            result.update(
                self._check_weights(
                    weights(model), steps_taken, result["numerics"], built.get("repeat", False)
                )
            )
        result["checksum"] = sum(float(v.double().sum()) for v in weights(model).values())
        if cfg.audit and device.type == "cuda":
            result.update(self._audit(model, forward, backward, step_fn))
        if built.get("close") is not None:
            try:
                built["close"]()  # what garbage collection alone would not free
            except Exception as e:  # noqa: BLE001 - the measurements stand; note the failure
                result["close_error"] = f"{type(e).__name__}: {e}"[:300]
        del built, model, opt, step_fn
        _empty_caches(device)
        return result

    def _audit(self, model, forward, backward, step_fn) -> dict[str, Any]:
        """One more training iteration, batch transfer included, under the memcpy audit."""
        from offloadopt.audit import audit

        gen = torch.Generator().manual_seed(self.cfg.seed + 99)
        with audit() as a:
            x, y = get_batch(
                self.data, "train", self.cfg.batch_size, self.cfg.seq_len, gen, self.device
            )
            backward(forward(model, x, y))
            step_fn()
            _sync(self.device)
        rows = a.report.rows
        link = [r for r in rows if r.direction in ("HtoD", "DtoH")]
        return {
            "pageable_copies": a.report.pageable_count,
            "link_copies": sum(r.count for r in link),
            "link_nbytes": sum(r.nbytes for r in link),
            "audit": a.report.to_dict(),
        }

    @staticmethod
    def _weights(model) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in model.state_dict().items()
            if v.is_floating_point()
        }

    def _check_weights(
        self, weights: dict[str, torch.Tensor], steps: int, numerics: str, repeat: bool
    ) -> dict[str, Any]:
        """RMS relative difference from the baseline's weights after as many steps."""
        base = self.baseline.get(steps)
        if base is None:
            return {"status": "no baseline weights at this step count"}
        num = den = 0.0
        for k, v in weights.items():
            if k in base:
                b = base[k].float()
                num += float((v.float() - b).pow(2).sum())
                den += float(b.pow(2).sum())
        rel = math.sqrt(num / den) if den else 0.0
        out: dict[str, Any] = {"rms_rel_diff": rel}
        if repeat:
            self.noise_floor = rel
            out["status"] = "noise floor (baseline run again)"
        elif numerics != "same":
            out["status"] = f"other numerics ({numerics})"
        elif self.noise_floor is None:
            out["status"] = "unchecked (no noise floor)"
        else:
            limit = DRIFT_FACTOR * max(self.noise_floor, 1e-7)
            out["status"] = (
                "ok" if rel <= limit else f"DRIFT (rms rel diff {rel:.2e} > {limit:.2e})"
            )
        return out


def _tagged(build, **tags):
    """A builder whose result carries extra keys (``baseline``, ``repeat``)."""

    def tagged(model, lr):
        return {**build(model, lr), **tags}

    return tagged


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Run every configuration of ``cfg``; returns (and writes) the list of results.

    Raises ``UsageError`` for a bad ``cfg`` before anything is built or written.
    """
    from tqdm import tqdm

    ranks = Dist()
    if cfg.fsdp:
        if "WORLD_SIZE" not in os.environ:
            raise UsageError("--fsdp: run under torchrun (torchrun --nproc-per-node N -m "
                             "offloadopt bench --fsdp); WORLD_SIZE is not set")  # fmt: skip
        ranks = init_from_env(cfg.device)
        if torch.device(cfg.device).type == "cuda":
            cfg = replace(cfg, device=f"cuda:{ranks.local_rank}")  # this rank's GPU
        cfg = replace(cfg, kernel=False, progress=cfg.progress and ranks.main)
    bench = Bench(cfg)
    cfg, device, out = bench.cfg, bench.device, Path(bench.cfg.out)
    header = {"config": asdict(cfg), "torch": torch.__version__, "params": models.num_params(bench.model),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
              "cpu_threads": torch.get_num_threads(), "commit": provenance.commit(),
              "cpu": provenance.cpu_name(), "versions": provenance.versions(),
              "world_size": ranks.world}  # fmt: skip
    if device.type == "cpu":  # what such a run measures, in its JSON and above its table
        header["measures"] = provenance.CPU_BENCH_NOTE
    rep = anchors.representation(cfg.state_dtype, cfg.master_weights)  # HybridAdamW state
    if cfg.fsdp and rep:
        raise UsageError("--state-dtype/--master-weights: compressed state is not supported "
                         "with --fsdp (FSDP2 params) yet")  # fmt: skip
    base = anchors.hybrid_fsdp2 if cfg.fsdp else partial(anchors.hybrid, **rep)
    tag = "hybrid-fsdp2" if cfg.fsdp else "hybrid"
    jobs = [(f"{tag}:0", _tagged(base(0.0), baseline=True), False),
            (f"{tag}:0 (repeat)", _tagged(base(0.0), repeat=True), False)]  # fmt: skip
    jobs += [(f"{tag}:{f:g}", base(f), False) for f in sorted(set(cfg.fractions) - {0.0})]
    if cfg.fsdp and set(cfg.modes) - {"step"}:
        raise UsageError("--overlap: with --fsdp the bench runs step mode only (its FSDP2 "
                         "anchors name their own modes)")  # fmt: skip
    jobs += [(f"hybrid-{mode}:{f:g}", anchors.hybrid(f, mode, **rep), False)
             for mode in cfg.modes if mode != "step" for f in sorted(set(cfg.fractions))]  # fmt: skip
    results: list[dict[str, Any]] = []
    for name in cfg.anchors:
        if cfg.fsdp and name not in FSDP2_ANCHORS:
            results.append({"name": name, "kind": "anchor",
                            "status": "skipped: not an FSDP2 configuration (--fsdp)"})  # fmt: skip
        elif device.type == "cuda":
            builder, slow = anchors.ANCHORS[name]
            jobs.append((name, builder, slow))
        else:  # the anchors offload to the host from a GPU: say so, do not drop them silently
            results.append(
                {"name": name, "kind": "anchor", "status": "skipped: needs a CUDA device"}
            )

    def write(done: bool = False) -> None:
        """The rows so far into bench.partial.json; the whole run, at its end, into bench.json
        (an interrupted run leaves a previous run's bench.json as it was)."""
        if cfg.fsdp:
            return  # rank 0 writes the job's results once, gathered (below)
        out.mkdir(parents=True, exist_ok=True)  # here, so a run that fails first leaves none
        partial = out / "bench.partial.json"
        text = json.dumps({**header, "results": results}, indent=1, default=str)
        checks.write_atomic(out / "bench.json" if done else partial, text)
        if done:
            partial.unlink(missing_ok=True)

    if cfg.kernel:
        shapes = [p.shape for p in bench.model.parameters()]
        results.append({"name": "fused-kernel-alone", "kind": "kernel", **time_kernel(shapes)})
        if cfg.state_dtype != "fp32" or cfg.master_weights == "bf16-sr":
            # the configurations' CPU update is offloadopt's kernel, not torch's: time it too
            bf16_master = cfg.master_weights == "bf16-sr" and cfg.dtype == "bf16"
            results[-1].update(time_compressed_kernel(shapes, cfg.state_dtype, bf16_master))
        if device.type == "cuda":
            results[-1].update(time_link(device))
            _empty_caches(device)
        write()
    bar = None if cfg.progress else True  # None: tqdm's own rule, a bar on a terminal only
    for name, builder, slow in tqdm(jobs, desc="configurations", disable=bar):
        try:
            results.append(bench.run(name, builder, slow))
        except anchors.Unavailable as e:
            results.append({"name": name, "kind": "anchor", "status": f"skipped: {e}"})
        except Exception as e:  # noqa: BLE001 - one broken anchor must not lose the others
            results.append(
                {"name": name, "kind": "anchor", "status": f"error: {type(e).__name__}: {e}"[:300]}
            )
            _empty_caches(device)
        write()
    if cfg.fsdp:
        results = merge_ranks(results, ranks, cfg.batch_size * cfg.seq_len)
        if not ranks.main:
            return results
        cfg = replace(cfg, fsdp=False)
    write(done=True)
    if "measures" in header:
        print(f"bench {header['measures']}")
    print(format_table(results))
    for line in sweep_summary(results):
        print(line)
    plot(results, out / "bench.png")
    return results


# The anchors that are FSDP2 configurations themselves (``--fsdp`` runs only these).
FSDP2_ANCHORS = tuple(name for name in anchors.ANCHORS if "fsdp2" in name)


def run(args: argparse.Namespace) -> int:
    """``offloadopt bench``: 0 when every configuration ran (or was skipped as unavailable),
    1 when one failed; its error is in the table and in bench.json."""
    given = {k: v for k, v in vars(args).items() if k in BenchConfig.__dataclass_fields__}
    # the defaults that depend on the machine (None in the parser, which does not import torch)
    given["device"] = resolve_device(args.device)
    if args.preset is None:
        given["preset"] = "gpt2-xl" if torch.cuda.is_available() else "tiny"
    cfg = BenchConfig(**given, kernel=not args.no_kernel, audit=not args.no_audit,
                      progress=not args.no_progress)  # fmt: skip
    try:
        results = run_bench(cfg)
    finally:
        teardown()  # --fsdp: the job's process group (nothing otherwise)
    if os.environ.get("RANK", "0") != "0":
        return 0  # rank 0 speaks for the job
    print(json.dumps({"out": str(Path(cfg.out) / "bench.json"), "configurations": len(results)}))
    failed = [r["name"] for r in results if str(r.get("status", "")).startswith("error")]
    if failed:
        print(f"offloadopt: error: {len(failed)} of {len(results)} configurations failed: "
              f"{', '.join(failed)} (their errors: the table, bench.json)", file=sys.stderr)  # fmt: skip
        return 1
    return 0
