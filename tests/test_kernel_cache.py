"""The kernel's build cache: a damaged library is built again, never mapped; installs that share
``$OFFLOADOPT_KERNEL_DIR`` keep a build each; a folder no one may write is named as such; a
process that waits on another's build says so. The builds here are torch's loader faked (it
writes a library of a few bytes): what is tested is what gets built and what gets imported."""

import fcntl
import threading
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from offloadopt import kernels


@pytest.fixture
def fake(monkeypatch):
    """torch's loader and the import faked: ``builds`` and ``imports`` list the names."""
    builds, imports = [], []

    def fake_load(name, build_directory, **_):
        builds.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF built " + name.encode())
        return ("built", name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(
        kernels, "_import", lambda path, name: imports.append(name) or ("imported", name)
    )
    return builds, imports


def test_a_damaged_library_is_built_again_not_imported(fake, tmp_path, capsys):
    """A truncated library was imported (SIGBUS: the process died without a word), and one
    of random bytes raised a raw ImportError, every run after, until the folder was deleted."""
    builds, imports = fake
    directory = tmp_path / "k"
    assert kernels._build(directory)[0] == "built"
    (so,) = directory.glob("*.so")
    assert kernels._build(directory)[0] == "imported"
    capsys.readouterr()
    for damage in (so.read_bytes()[:5], b"", so.read_bytes()[:-1] + b"!"):
        so.write_bytes(damage)
        assert kernels._build(directory)[0] == "built"
        assert "does not match its record (damaged)" in capsys.readouterr().err
    assert len(builds) == 4 and len(imports) == 1


def test_installs_sharing_one_folder_keep_a_build_each(fake, tmp_path, monkeypatch):
    """Two cache keys (two torch versions, or two checkouts' sources) in one
    ``$OFFLOADOPT_KERNEL_DIR``: each built once, then both imported (one stamp named only the
    last build, so they rebuilt each other at every switch, 45 s each)."""
    builds, imports = fake
    directory = tmp_path / "k"
    for key in ("aaaa", "bbbb", "aaaa", "bbbb"):
        monkeypatch.setattr(kernels, "cache_key", lambda key=key: key)
        kernels._build(directory)
    assert builds == ["offloadopt_adam_cpu_aaaa", "offloadopt_adam_cpu_bbbb"]
    assert imports == builds


def test_a_library_that_does_not_load_is_one_line(fake, tmp_path, monkeypatch):
    directory = tmp_path / "k"
    kernels._build(directory)

    def broken(path, name):
        raise ImportError(f"{path}: undefined symbol: _ZN3c104cuda\nmore")

    monkeypatch.setattr(kernels, "_import", broken)
    with pytest.raises(kernels.KernelBuildError) as info:
        kernels._build(directory)
    msg = str(info.value)
    assert "\n" not in msg and "did not load" in msg and "undefined symbol" in msg
    assert f"delete {directory}" in msg


def test_a_folder_this_user_may_not_write_is_named_not_the_compiler(fake, tmp_path, monkeypatch):
    """A read-only kernel folder said "install g++ ... and ninja", which would not help."""

    def refuse(name, build_directory, **_):
        raise OSError(30, "Read-only file system", build_directory)

    monkeypatch.setattr(cpp_extension, "load", refuse)
    monkeypatch.setattr(kernels, "_writable", lambda d: False)
    with pytest.raises(kernels.KernelBuildError) as info:
        kernels._build(tmp_path / "k")
    msg = str(info.value)
    assert "Read-only file system" in msg and "OFFLOADOPT_KERNEL_DIR" in msg
    assert "install g++" not in msg


def test_a_process_waiting_for_another_build_says_so(fake, tmp_path, capsys):
    """The second of two processes started together on an empty folder printed nothing for
    the 40 s it waited for the first one's build."""
    directory = tmp_path / "k"
    directory.mkdir()
    out = {}
    with open(directory / "offloadopt.lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # as another process's build holds it
        t = threading.Thread(target=lambda: out.setdefault("r", kernels._build(directory)))
        t.start()
        t.join(timeout=2.0)
        assert t.is_alive()  # waits for the lock
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    t.join(timeout=60)
    assert out["r"][0] == "built"
    assert "waiting for another process's build" in capsys.readouterr().err


@pytest.mark.parametrize(
    "params, options, match",
    [
        ("fp16", dict(master_weights="bf16-sr"), "torch.float16"),
        ("complex", dict(state_dtype="int8"), "complex parameters are not supported"),
        ("int", dict(state_dtype="int8"), "only floating-point params"),
        ("none", dict(state_dtype="bf16"), "empty parameter list"),
    ],
)
def test_a_refused_param_is_named_before_the_kernel_is_built(monkeypatch, params, options, match):
    """These were refused only after the 40 s build, and without a compiler the build's
    "install g++" hid the real error."""
    import torch

    from offloadopt import HybridAdamW

    def no_compiler():
        raise kernels.KernelBuildError("offloadopt: ... install g++; the build said: not found")

    monkeypatch.setattr(kernels, "load", no_compiler)
    make = {"fp16": lambda: torch.randn(8, dtype=torch.float16),
            "complex": lambda: torch.randn(8, dtype=torch.complex64),
            "int": lambda: torch.ones(8, dtype=torch.int32)}  # fmt: skip
    ps = (
        []
        if params == "none"
        else [torch.nn.Parameter(make[params](), requires_grad=params != "int")]
    )
    with pytest.raises(ValueError, match=match):
        HybridAdamW(ps, **options)
    with pytest.raises(kernels.KernelBuildError):  # a good param still needs the kernel
        HybridAdamW([torch.nn.Parameter(torch.randn(8))], **options)


def test_a_record_from_before_the_check_is_built_again_saying_why(fake, tmp_path, capsys):
    """A build recorded by an older offloadopt (no size and sha256) is built again once,
    and the notice says why (it read "does not match its record", as damage would)."""
    builds, imports = fake
    directory = tmp_path / "k"
    kernels._build(directory)
    name = builds[0]
    (directory / kernels.STAMP).write_text(f"{name} built in 40.0 s, torch 2.13.0+cpu\n")
    capsys.readouterr()
    assert kernels._build(directory)[0] == "built"
    err = capsys.readouterr().err
    assert "predates the size and sha256 check" in err and "damaged" not in err
    assert kernels._build(directory)[0] == "imported" and len(builds) == 2


def test_a_record_from_before_the_check_in_a_read_only_folder_is_imported(
    fake, tmp_path, monkeypatch
):
    """No build could replace it there (an administrator's shared folder): imported, as the
    offloadopt that recorded it did, not refused."""
    builds, imports = fake
    directory = tmp_path / "k"
    kernels._build(directory)
    (directory / kernels.STAMP).write_text(f"{builds[0]} built in 40.0 s, torch 2.13.0+cpu\n")
    monkeypatch.setattr(kernels, "_writable", lambda d: False)
    assert kernels._build(directory)[0] == "imported" and len(builds) == 1


def test_a_kernel_folder_that_is_a_file_is_named(fake, tmp_path):
    path = tmp_path / "k"
    path.write_text("not a folder")
    with pytest.raises(kernels.KernelBuildError, match="it is a file, not a folder") as info:
        kernels._build(path)
    assert "install g++" not in str(info.value)


def test_the_setup_checks_come_before_the_kernel_is_built(monkeypatch):
    """A group's 'offload' key with offload_fraction='auto' was refused after the build."""
    import torch

    from offloadopt import HybridAdamW

    def no_compiler():
        raise kernels.KernelBuildError("offloadopt: ... install g++; the build said: not found")

    monkeypatch.setattr(kernels, "load", no_compiler)
    group = {"params": [torch.nn.Parameter(torch.randn(8))], "offload": True}
    with pytest.raises(ValueError, match="auto"):
        HybridAdamW([group], offload_fraction="auto", state_dtype="int8")
