"""What a placement costs: predicted step time and memory at any offload fraction, from a few
measurements of one run. Pure arithmetic, no CUDA calls (the placement policy's sibling,
offloadopt/place/placement.py).

The model (tests/test_costmodel.py checks it against the H200 runs recorded in benchmarks/):

- *CPU work* of fraction ``f``: the worker's fused kernel over the ``f * params`` offloaded
  elements (``cpu_ns_per_param``, measured while a step's copies cross the link), plus
  ``bucket_overhead_ms`` per bucket of ``bucket_nbytes`` fp32 state (the hand-offs between
  buckets: events, a launch, the GIL), plus the pipeline's fill and drain: the first bucket's
  D2H and the last one's H2D at the link's bandwidth.
- *Device work*: the fused kernel over the ``(1 - f) * params`` device-resident elements
  (``device_ns_per_param``).
- ``overlap="step"``: forward+backward, then the device work, then the CPU work.
- ``overlap="backward"`` (grads final, each module waiting for its own params): the CPU work
  hides behind the rest of backward and the next forward, a window of about one
  forward+backward; what is left shows. With gradient accumulation (``micro_steps`` forward
  and backward passes a step, the first inside ``opt.accumulating()``) the updates start in the
  last backward only: the window is one micro-step's, ``fwd_bwd_ms / micro_steps``.
- ``overlap="delayed"``: the CPU work of one step runs during the next forward and backward
  (all of a step's micro-steps); the step is the longer of the two.

Memory per param, bf16 params with fp32 masters (README, "Memory per parameter"): on the GPU 2
(weight) + 2 (grad) bytes for every param, 12 (master, ``exp_avg``, ``exp_avg_sq``) for the
device-resident ones, 4 staging slots as large as the largest bucket (at most
``bucket_nbytes``) when anything is offloaded, 2 more per
offloaded param with ``overlap="delayed"`` (the landing buffer), plus what forward and backward
hold (``activation_bytes``, measured); on the host 12 per offloaded param and 2 pinned slots.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Measurements", "Prediction", "predict", "smallest_fitting", "largest_hidden",
           "cost_mode", "measurements",
           "parse_bytes", "format_bytes"]  # fmt: skip

MODES = ("step", "backward", "delayed")


@dataclass(frozen=True)
class Measurements:
    """The inputs, from one run (times in ms or ns, sizes in bytes).

    ``params``: trainable elements; ``fwd_bwd_ms``: forward + backward with nothing offloaded,
    all of a step's ``micro_steps`` (gradient accumulation: 1 + the non-final ones);
    ``device_ns_per_param``: the device-resident update; ``cpu_ns_per_param``: the worker's
    kernel while copies cross the link; ``d2h_gbps`` / ``h2d_gbps``: the link, GB/s of fp32
    state; ``bucket_overhead_ms``: per bucket above the kernel; ``activation_bytes``: the GPU
    peak beyond weights, grads, state and staging.
    """

    params: int
    fwd_bwd_ms: float
    device_ns_per_param: float
    cpu_ns_per_param: float
    d2h_gbps: float
    h2d_gbps: float
    bucket_overhead_ms: float
    activation_bytes: int = 0
    bucket_nbytes: int = 64 * 2**20
    weight_bytes: int = 2  # per param on the GPU (bf16)
    grad_bytes: int = 2
    state_bytes: int = 12  # fp32 master + exp_avg + exp_avg_sq
    # per offloaded param, the host copy of the weights where no fp32 master is in state_bytes
    # (fp32 params, master_weights=False, "bf16-sr"): host bytes only
    host_copy_bytes: int = 0
    micro_steps: int = 1  # forward+backward passes in fwd_bwd_ms (gradient accumulation)

    def __post_init__(self) -> None:
        steps = self.micro_steps
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(
                f"Invalid micro_steps: {self.micro_steps!r} (expected an integer >= 1)"
            )
        for name in ("params", "bucket_nbytes", "d2h_gbps", "h2d_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"Invalid {name}: {value!r} (expected a finite number > 0)")
        for name in ("fwd_bwd_ms", "device_ns_per_param", "cpu_ns_per_param",
                     "bucket_overhead_ms", "activation_bytes", "weight_bytes", "grad_bytes",
                     "state_bytes", "host_copy_bytes"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"Invalid {name}: {value!r} (expected a finite number >= 0)")


@dataclass(frozen=True)
class Prediction:
    fraction: float
    mode: str
    step_ms: float
    cpu_ms: float  # the worker's share: kernel, bucket overheads, fill and drain
    gpu_bytes: int
    host_bytes: int


def _check(m: Measurements, fraction: float, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (expected one of {', '.join(MODES)})")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction: {fraction!r} (expected 0 <= fraction <= 1)")
    if m.params <= 0 or m.bucket_nbytes <= 0:
        raise ValueError(
            f"Invalid measurements: params {m.params}, bucket_nbytes {m.bucket_nbytes}"
        )


def predict(m: Measurements, fraction: float, mode: str = "step") -> Prediction:
    """Step time and memory of ``fraction`` in ``mode`` (see the module docstring).

    Raises:
        ValueError: a fraction outside [0, 1], an unknown mode, or no params.
    """
    _check(m, fraction, mode)
    offloaded = fraction * m.params
    fp32 = offloaded * 4
    buckets = math.ceil(fp32 / m.bucket_nbytes) if offloaded else 0
    first = min(fp32, m.bucket_nbytes)  # the pipeline's fill (D2H) and drain (H2D)
    fill_ms = first / (m.d2h_gbps * 1e6) + first / (m.h2d_gbps * 1e6) if offloaded else 0.0
    cpu_ms = offloaded * m.cpu_ns_per_param * 1e-6 + buckets * m.bucket_overhead_ms + fill_ms
    device_ms = (m.params - offloaded) * m.device_ns_per_param * 1e-6
    if mode == "step":
        step = m.fwd_bwd_ms + device_ms + cpu_ms
    elif mode == "backward":  # hidden behind the last micro-step's backward and the next forward
        step = m.fwd_bwd_ms + device_ms + max(0.0, cpu_ms - m.fwd_bwd_ms / m.micro_steps)
    else:
        step = max(m.fwd_bwd_ms + device_ms, cpu_ms)
    gpu = m.params * (m.weight_bytes + m.grad_bytes) + (m.params - offloaded) * m.state_bytes
    gpu += m.activation_bytes + 4 * first  # staging: slots as large as the largest bucket
    if mode == "delayed":
        gpu += offloaded * m.weight_bytes  # the landing buffers of the next weights
    host = offloaded * (m.state_bytes + m.host_copy_bytes) + 2 * first
    return Prediction(fraction, mode, step, cpu_ms, int(gpu), int(host))


def _grid(step: float) -> list[float]:
    """Fractions 0, step, 2 step, ..., 1.

    Raises:
        ValueError: ``step`` not in (0, 1] or not 1 / an integer.
    """
    n = round(1 / step) if isinstance(step, (int, float)) and 0 < step <= 1 else 0
    if n < 1 or abs(n * step - 1) > 1e-9:
        raise ValueError(f"Invalid step: {step!r} (expected 1 / an integer, such as 0.01)")
    return [k / n for k in range(n + 1)]


def smallest_fitting(m: Measurements, gpu_budget: int | str, mode: str = "step",
                     host_budget: int | str | None = None, step: float = 0.01) -> Prediction:  # fmt: skip
    """The smallest fraction (on a grid of ``step``) whose GPU bytes fit ``gpu_budget``; with
    ``host_budget``, its host bytes must fit too. Step time grows with the fraction, so this
    is also the fastest placement that fits. Budgets are bytes or strings ("120GB").

    Raises:
        ValueError: a bad budget or ``step``; no fraction fits; the message gives both memories' figures at fraction 1
            (GPU) or at the fraction the GPU needs (host).
    """
    gpu_budget = parse_bytes(gpu_budget)
    host_budget = None if host_budget is None else parse_bytes(host_budget)
    for f in _grid(step):
        p = predict(m, f, mode)
        if p.gpu_bytes <= gpu_budget:
            if host_budget is not None and p.host_bytes > host_budget:
                raise ValueError(
                    f"fraction {f:g} fits the GPU budget {format_bytes(gpu_budget)} but needs "
                    f"{format_bytes(p.host_bytes)} of host memory, more than "
                    f"{format_bytes(host_budget)}"
                )
            return p
    full = predict(m, 1.0, mode)
    raise ValueError(
        f"no offload fraction fits the GPU budget {format_bytes(gpu_budget)}: even fraction 1 "
        f"needs {format_bytes(full.gpu_bytes)} (weights and grads "
        f"{format_bytes(m.params * (m.weight_bytes + m.grad_bytes))}, activations "
        f"{format_bytes(m.activation_bytes)}, staging {format_bytes(4 * min(m.params * 4, m.bucket_nbytes))})"
    )


def largest_hidden(m: Measurements, tolerance: float = 0.05, mode: str = "backward",
                   step: float = 0.01) -> Prediction:  # fmt: skip
    """The largest fraction whose predicted step stays within ``1 + tolerance`` of fraction
    0's (the CPU work still hides behind the GPU's).

    Raises:
        ValueError: a negative tolerance.
    """
    if not tolerance >= 0:
        raise ValueError(f"Invalid tolerance: {tolerance!r} (expected >= 0)")
    limit = predict(m, 0.0, mode).step_ms * (1 + tolerance)
    best = predict(m, 0.0, mode)
    for f in _grid(step):
        p = predict(m, f, mode)
        if p.step_ms <= limit:
            best = p
    return best


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | float | str, allow_zero: bool = False) -> int:
    """Bytes from a number or a string: ``"120GB"`` is 120e9 bytes, ``"112GiB"`` 112 x 2**30,
    ``"1.5 TB"``, ``"512MiB"``, ``"8e9"``.

    Raises:
        ValueError: anything else, or a size that is not positive (zero passes with
            ``allow_zero``); the value is named.
    """
    if isinstance(value, bool):
        raise ValueError(f"Invalid size: {value!r} (expected bytes, or a string like '120GB')")
    if isinstance(value, int):
        if value > 0 or (allow_zero and value == 0):
            return value  # exact: no float on the way
        raise ValueError(f"Invalid size: {value!r} (expected a positive size)")
    if isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"Invalid size: {value!r} (expected bytes, or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, like '120GB' or '112GiB')"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"Invalid size: {value!r} (expected bytes, or a string like '120GB')")
    if unit == "" and math.isfinite(number) and not float(number).is_integer():
        # A fresh user's finding: 1.5 was taken as 1 byte, and the error at the first step
        # named "0.00 KB", not the value given.
        raise ValueError(
            f"Invalid size: {value!r} (expected whole bytes, or a number with a unit like '1.5GB')"
        )
    nbytes = number * _UNITS[unit]
    if not math.isfinite(nbytes) or not (int(nbytes) > 0 or (allow_zero and nbytes == 0)):
        raise ValueError(f"Invalid size: {value!r} (expected a positive size of whole bytes)")
    return int(nbytes)


def format_bytes(nbytes: float) -> str:
    """``"120.00 GB (111.76 GiB)"``: both units, as the messages show them (MB/MiB or KB/KiB
    below a GB or an MB)."""
    for decimal, binary, unit in ((1e12, 2**40, "T"), (1e9, 2**30, "G"), (1e6, 2**20, "M")):
        if abs(nbytes) >= decimal:
            return f"{nbytes / decimal:.2f} {unit}B ({nbytes / binary:.2f} {unit}iB)"
    return f"{nbytes / 1e3:.2f} KB ({nbytes / 2**10:.2f} KiB)"


# The measured inputs of offload_fraction="auto" (offloadopt/place/auto.py).
_NO_LINK_GBPS = 1e3  # without CUDA the "link" is a memcpy the worker's time already holds


def cost_mode(overlap: str, grads_final: bool, max_grad_norm: float | None) -> str:
    """The cost model's mode for these options: backward mode whose updates wait for
    ``step()`` (no ``grads_final``, no ``max_grad_norm``) costs what step mode does."""
    if overlap == "backward" and not (grads_final or max_grad_norm is not None):
        return "step"
    return overlap


def measurements(
    *,
    fwd_bwd_ms: float,
    device_update_ms: float,
    stats: dict[str, float],
    device_numel: int,
    offloaded_numel: int,
    bucket_nbytes: int,
    weight_bytes: int = 2,
    state_bytes: int = 12,
    host_copy_bytes: int = 0,
    micro_steps: int = 1,
) -> Measurements:
    """:class:`Measurements` from one placement's figures: the medians of the
    windows (ms), the optimizer's ``stats`` of a step there (the worker's kernel time, its busy
    time, the buckets, the link's bytes and GPU times), the elements on each side and the
    micro-steps a step has (gradient accumulation). The
    per-bucket overhead is the worker's busy time (``worker_ms`` less its waits for D2H and for
    buckets backward had not announced yet, as with ``release_grads``) beyond the kernel, per
    bucket.

    Raises:
        ValueError: no offloaded elements (nothing to measure the worker on), or a figure the
            cost model refuses (named).
    """
    if offloaded_numel <= 0:
        raise ValueError("offload_fraction='auto': no param is offloaded at the probe fraction")

    def gbps(key: str) -> float:
        ms, nbytes = stats.get(f"{key}_ms", 0.0), stats.get(f"{key}_nbytes", 0.0)
        return nbytes / (ms * 1e6) if ms > 0 and nbytes > 0 else _NO_LINK_GBPS

    kernel_ms = stats.get("cpu_update_ms", 0.0)
    waits_ms = stats.get("d2h_wait_ms", 0.0) + stats.get("feed_wait_ms", 0.0)
    busy_ms = stats.get("worker_ms", 0.0) - waits_ms
    return Measurements(
        params=device_numel + offloaded_numel,
        fwd_bwd_ms=max(fwd_bwd_ms, 0.0),
        device_ns_per_param=device_update_ms * 1e6 / device_numel if device_numel else 0.0,
        cpu_ns_per_param=kernel_ms * 1e6 / offloaded_numel,
        d2h_gbps=gbps("d2h"), h2d_gbps=gbps("h2d"),
        bucket_overhead_ms=max(0.0, busy_ms - kernel_ms) / max(1, stats.get("buckets", 1)),
        bucket_nbytes=bucket_nbytes, weight_bytes=weight_bytes, grad_bytes=weight_bytes,
        state_bytes=state_bytes, host_copy_bytes=host_copy_bytes, micro_steps=micro_steps,
    )  # fmt: skip
