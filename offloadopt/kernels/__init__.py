"""A fused CPU Adam/AdamW step for compressed optimizer state (and the speculative updates'
pre-step backups, offloadopt/step/speculate.py), built on first use.

``load()`` compiles ``adam_cpu.cpp`` (shipped in this package) with
``torch.utils.cpp_extension.load`` the first time a process asks for it and returns the module;
its one entry point is::

    adam_step(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
              weights_out, steps, salts, offsets, lr, beta1, beta2, weight_decay, eps,
              maximize, decoupled, grad_scale, moments, master_sr, vec_size, flush_denormal,
              backups=[])

Every list holds one entry per tensor (or is empty where noted); every tensor is 1-D,
contiguous, on the CPU; tensor i of each list has the same numel ``n_i``.

- ``masters``: float32 (the fp32 master) or bfloat16 (the bf16 weight itself; then
  ``master_sr`` must be True: the new master is rounded back to bf16 stochastically).
  Updated in place.
- ``grads``: float32 or bfloat16 (upcast exactly); read only.
- ``exp_avgs`` / ``exp_avg_sqs``: ``moments=0`` float32; ``1`` bfloat16 (stochastic
  rounding); ``2`` uint8 int8-block codes (``formats``) with ``exp_avg_scales`` /
  ``exp_avg_sq_scales`` float32 of ``nblocks(n_i)`` entries each (empty lists otherwise).
- ``weights_out``: empty, or per tensor a bfloat16 ``(n_i,)`` that receives the new fp32
  master rounded to nearest even (fp32 masters only).
- ``steps``: per tensor its step count (float, already advanced, >= 1); ``salts``: per tensor
  a 64-bit int seeding the stochastic rounding; ``offsets``: per tensor the element index of
  its first element within its parameter (a multiple of ``BLOCK`` when the tensor is a piece
  of a larger parameter), so the rounding does not depend on where a parameter is cut.
- ``lr, beta1, beta2, weight_decay, eps``: floats; ``maximize``: bool; ``decoupled``: True for
  AdamW (``p *= 1 - lr*wd``), False for Adam (``g += wd*p``); ``grad_scale``: float or None
  (the grads are divided by it); ``vec_size``: ``torch_vec_size()``; ``flush_denormal``: set
  FTZ/DAZ in the kernel's threads for the call.
- ``backups``: empty, or per tensor (in tensor order) a destination for its pre-step master,
  exp_avg and exp_avg_sq, and with ``moments=2`` its exp_avg_scale and exp_avg_sq_scale (3 or 5
  entries per tensor), each of the dtype and numel of what it backs up: the kernel copies the
  values there just before it overwrites them (in cache-sized runs, with streaming stores where
  the CPU has them; ``set_backup_stream(False)`` makes them plain copies).

With fp32 masters and fp32 moments the result is bitwise equal to ``torch._fused_adamw_`` /
``torch._fused_adam_`` (on AVX512 and, by inference, AVX2 hosts). Bad input raises ValueError
naming the offending entry before anything is written. The work is split over
``torch.get_num_threads()`` threads in blocks of 256 elements; results do not depend on the
thread count.

``offloadopt.kernels`` imports nothing else from offloadopt.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from offloadopt.kernels.formats import BLOCK, decode_m, decode_v, encode_m, encode_v, nblocks

__all__ = [
    "BLOCK",
    "KernelBuildError",
    "available",
    "decode_m",
    "element_nbytes",
    "decode_v",
    "encode_m",
    "encode_v",
    "kernel_ms",
    "load",
    "nblocks",
    "torch_vec_size",
]

SOURCE = Path(__file__).with_name("adam_cpu.cpp")
# everything the build compiles (the .cpp includes these headers): the cache key hashes them
HEADERS = [
    Path(__file__).with_name("cpu") / name
    for name in (
        "sr_keys.h",
        "arg_checks.h",
        "simd.h",
        "int8_codes.h",
        "bf16_bits.h",
        "adam_body.h",
    )
]
# No -march=native: the body is compiled for AVX-512, AVX2 and plain C++ in one build and the
# kernel picks the ISA at run time (``isa()``), so one build serves every CPU of the
# architecture and the cache key does not depend on the host.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
HINT = (
    "offloadopt: compressed optimizer state (state_dtype='int8'/'bf16', master_weights='bf16-sr') "
    "and speculate=True's fast backups need a C++ compiler and ninja to build offloadopt's CPU "
    "kernel: install g++ (apt install g++) and ninja (pip install ninja)"
)
# written after a build succeeds, one line a finished build: its name (the cache key), the
# library's size and sha256 (checked before each import: a damaged file is built again, not
# mapped, where a truncated one crashed the process with SIGBUS), how long it took
STAMP = "offloadopt-build.txt"

_lock = threading.Lock()
_module: ModuleType | None = None
_error: KernelBuildError | None = None


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be built (no compiler, no ninja, or a compiler error); the
    message is one line saying what to install and the build's last line of output."""


def torch_vec_size() -> int:
    """Floats per vector in torch's CPU kernels on this host: 16 (AVX512), 8 (AVX2), 4 (no
    AVX: torch's DEFAULT build); the kernel's ``vec_size`` argument."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    if "AVX512" in cap:
        return 16
    if "AVX2" in cap or "SVE256" in cap:
        return 8
    return 4


def cache_key() -> str:
    """A hash of what the build depends on, and nothing about who asks (16 hex digits): the
    sources' bytes, torch's version, the Python ABI, the flags and the architecture. Not the
    source's path nor the CPU: a checkout and a venv install of one version, pytest and a
    script, the CLI and a notebook all load one build (they rebuilt each other's in turn when
    torch's loader ran ninja on every load: a fresh user's finding)."""
    h = hashlib.sha256()
    parts = [p.read_bytes() for p in (SOURCE, *HEADERS)]
    parts += [torch.__version__.encode(), sys.implementation.cache_tag.encode(),
              " ".join(CFLAGS + LDFLAGS).encode(), platform.machine().encode()]  # fmt: skip
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """``$OFFLOADOPT_KERNEL_DIR`` if set, else ``~/.cache/offloadopt/kernels/<cache_key()>``."""
    env = os.environ.get("OFFLOADOPT_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "offloadopt" / "kernels" / cache_key()


def _last_line(text: str) -> str:
    """The build output's first compiler error line, else its last line."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln.lower()]
    return (errors or lines or ["(no output)"])[0 if errors else -1]


def _import(path: Path, name: str) -> ModuleType:
    """Import a built extension from its file (what torch's loader does after its build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(path: Path) -> str:
    """``<bytes>:<sha256>`` of a file (a built library: about 1 MB, a few ms)."""
    data = path.read_bytes()
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"


def _stamps(directory: Path) -> dict[str, str]:
    """The stamp's lines by build name (an unreadable or missing stamp: none)."""
    try:
        lines = (directory / STAMP).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    return {ln.split()[0]: ln for ln in lines if ln.split()}


def _recorded(directory: Path, name: str) -> str | None:
    """The size and sha256 the stamp records for the build ``name`` (``<bytes>:<sha256>``),
    ``""`` for a record written before they were recorded, None for no record."""
    line = _stamps(directory).get(name)
    if line is None:
        return None
    return next((w[len("digest=") :] for w in line.split() if w.startswith("digest=")), "")


def _finished(directory: Path, name: str, digest: str | None) -> Path | None:
    """The built library in ``directory`` if a build of ``name`` finished there and the file
    is still what that build wrote (``digest``, its :func:`_recorded` size and sha256), else
    None. Several installs may share one folder (``$OFFLOADOPT_KERNEL_DIR``): each has its line."""
    so = directory / f"{name}.so"
    try:
        return so if digest and _digest(so) == digest else None
    except OSError:
        return None


def _stamp(directory: Path, name: str, seconds: float) -> None:
    """Record the finished build of ``name`` in the stamp, beside the other builds' lines."""
    lines = _stamps(directory)
    lines[name] = (f"{name} digest={_digest(directory / f'{name}.so')} built in {seconds:.1f} s, "
                   f"torch {torch.__version__}")  # fmt: skip
    tmp = directory / f"{STAMP}.{os.getpid()}"
    tmp.write_text("".join(ln + "\n" for ln in lines.values()))
    os.replace(tmp, directory / STAMP)  # a reader sees the old stamp or the new, never half


def _import_finished(so: Path, name: str) -> ModuleType:
    """Import a finished, unchanged build; a library that still fails to load (a system
    library gone, another torch's ABI) is one clear line, not a traceback."""
    try:
        return _import(so, name)
    except (ImportError, OSError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise KernelBuildError(
            f"offloadopt: offloadopt's CPU kernel in {so.parent} did not load: {first} "
            f"(delete {so.parent} to build it again)"
        ) from e


def _build(directory: Path) -> ModuleType:
    """Import the finished build in ``directory``, or build it first (saying so, with its
    time). A finished build is imported without running ninja, so whoever asks and from
    whatever environment, nothing is rebuilt. Several processes building at once are
    serialized by an ``flock`` (:func:`_exclusive`; a stale baton of torch's, left by a killed
    build, is removed). Raises KernelBuildError."""
    import time

    name = f"offloadopt_adam_cpu_{cache_key()}"
    digest = _recorded(directory, name)
    so = _finished(directory, name, digest)
    if so is not None:
        return _import_finished(so, name)
    if directory.exists() and not directory.is_dir():
        raise KernelBuildError(f"offloadopt: offloadopt's CPU kernel cannot be built in "
                               f"{directory}: it is a file, not a folder (set "
                               "OFFLOADOPT_KERNEL_DIR to a folder)")  # fmt: skip
    so = directory / f"{name}.so"
    if digest == "" and so.exists() and not _writable(directory):
        # recorded by an offloadopt before the size and sha256 check, in a folder this user
        # cannot write (so no build could replace it): imported as that offloadopt did
        return _import_finished(so, name)
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"{HINT}; the build said: C++ compiler {cxx!r} not found")
    if not cpp_extension.is_ninja_available():
        raise KernelBuildError(f"{HINT}; the build said: ninja not found")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory):
            digest = _recorded(directory, name)  # another process may have built it meanwhile
            so = _finished(directory, name, digest)
            if so is not None:
                return _import_finished(so, name)
            why = ("" if digest is None
                   else ": its record predates the size and sha256 check" if digest == ""
                   else ": the cached build does not match its record (damaged)")  # fmt: skip
            (directory / f"{name}.so").unlink(missing_ok=True)  # mapped elsewhere: still safe
            print(
                f"offloadopt: building offloadopt's CPU kernel (once per torch version, "
                f"about 40 s; cached in {directory}){why}",
                file=sys.stderr,
                flush=True,
            )
            start = time.perf_counter()
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                # copies: torch's loader appends to the lists it is given (the cache key
                # hashes these)
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )
            seconds = time.perf_counter() - start
            _stamp(directory, name, seconds)
            print(f"offloadopt: built offloadopt's CPU kernel in {seconds:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            return module
    except KernelBuildError:
        raise
    except Exception as e:  # noqa: BLE001 - any build failure becomes one clear line
        if isinstance(e, OSError) and not _writable(directory):  # no compiler would help
            raise KernelBuildError(
                f"offloadopt: offloadopt's CPU kernel cannot be built in {directory}: "
                f"{_last_line(e)} (set OFFLOADOPT_KERNEL_DIR to a folder this user may write)"
            ) from e
        # g++ and ninja were found: say that the build failed first, then what it needs (the
        # bare hint read as "not installed" when the build failed for another reason)
        raise KernelBuildError(
            f"offloadopt: offloadopt's CPU kernel did not build in "
            f"{directory}; the build said: {_last_line(e)} (it needs a working C++ compiler "
            "and ninja: install g++ (apt install g++) and ninja (pip install ninja))"
        ) from e


def _writable(directory: Path) -> bool:
    """Whether this user may write ``directory`` (or, where it does not exist, the nearest
    folder above it that does)."""
    for d in (directory, *directory.parents):
        if d.exists():
            return os.access(d, os.W_OK)
    return False


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Hold an ``flock`` on ``directory/offloadopt.lock`` around a build or import.

    torch's file baton (``directory/lock``, made with O_EXCL) is never removed when the process
    holding it dies: a build killed part-way (Ctrl-C, OOM) left it, and every later process
    waited on it forever. The kernel releases an ``flock`` when its holder dies, so whoever
    holds this one is the only offloadopt process in the directory, and a baton found then is
    stale: it is removed. Without ``fcntl`` (not POSIX) only torch's baton serializes."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(directory / "offloadopt.lock", "a") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds: say so, then wait for it
            print(f"offloadopt: waiting for another process's build of offloadopt's CPU kernel "
                  f"in {directory}", file=sys.stderr, flush=True)  # fmt: skip
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def load() -> ModuleType:
    """The compiled kernel module (built once per process; the build is cached on disk in
    ``build_dir()``, so later processes only import it). Raises KernelBuildError."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            _module = _build(build_dir())
        except KernelBuildError as e:
            _error = e
            raise
        return _module


def kernel_ms() -> float:
    """Milliseconds spent inside the kernel's parallel regions since it was loaded, all calls
    and threads' calls summed (0.0 before it is loaded; this never builds it). The difference
    across a call is the kernel's own time, without the GIL, the checks or the Python around it
    (``opt.stats["cpu_kernel_ms"]`` against ``cpu_update_ms``)."""
    module = _module
    return 0.0 if module is None else module.kernel_ns() / 1e6


def element_nbytes(master_bf16: bool, grad_bf16: bool, moments: int, weights_out: bool) -> float:
    """Bytes the kernel reads and writes per element in a mode (each operand read once and each
    written once; int8 block scales included): the numerator of its GB/s."""
    master = 2 if master_bf16 else 4
    state = {0: 4, 1: 2, 2: 1}[moments]
    scales = 2 * 2 * 4 / BLOCK if moments == 2 else 0.0  # two scales, read and written
    return 2 * master + (2 if grad_bf16 else 4) + 4 * state + (2 if weights_out else 0) + scales


def available() -> bool:
    """Whether ``load()`` succeeds (builds on first call); never raises."""
    try:
        load()
    except Exception:  # noqa: BLE001
        return False
    return True
