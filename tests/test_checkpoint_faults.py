"""Fault suite for checkpoints (issue 44): damage a checkpoint, or kill or starve its save at
every step, then load it into a fresh optimizer and model. Each case must end in one of three
ways: the previous checkpoint loaded bitwise, the new one loaded bitwise, or a refusal
(``ValueError``, or ``UsageError`` for the main job's file) with nothing changed. Seeded and
deterministic; each test prints its counts (run with ``-s`` to see them):

- damage: random single-byte flips, 64-byte overwrites, truncations and deletions of the
  parts and of the index of a streamed checkpoint, and the same on a ``--save`` file;
- kills: a save stopped before each of its steps (each file written, half-written, each
  rename, each folder flush, the clean-up), as SIGKILL would leave the folder (the saving
  process gone: no clean-up ran), then loaded by a fresh process;
- a full disk: ``ENOSPC`` from the writer at random points, and a real tmpfs where this
  process may mount one (root).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import types

import pytest
import torch

from offloadopt import HybridAdamW
from offloadopt.harness import checks
from offloadopt.harness.options import TrainConfig
from offloadopt.harness.train_checkpoint import load_checkpoint, save_checkpoint
from offloadopt.state import integrity, leftovers, streamed

DEAD = 2**22 + 4044  # above the default pid_max: a process that is gone


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(
        torch.bfloat16
    )


def trained(seed: int, steps: int) -> tuple[torch.nn.Module, HybridAdamW]:
    m = model(seed)
    opt = HybridAdamW(m.parameters(), lr=1e-2, state_dtype="int8", offload_fraction=0.5,
                      min_offload_numel=1)  # fmt: skip
    more(m, opt, steps, seed)
    return m, opt


def more(m, opt, steps: int, seed: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * seed + i))
        m(x.to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(m, opt) -> list[torch.Tensor]:
    opt.synchronize()
    out = [p.detach().clone() for p in m.parameters()]
    for p in m.parameters():
        out += [v.detach().clone() for _, v in sorted(opt.state[p].items())]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1), y.view(-1))
        for x, y in zip(a, b, strict=True)
    )


class Counts:
    """What the cases came to; the assertions are that ``wrong`` and ``changed`` stay 0."""

    def __init__(self, name: str):
        self.name, self.cases, self.detected, self.previous, self.new = name, 0, 0, 0, 0
        self.wrong, self.changed = [], []  # case names

    def __str__(self) -> str:
        return (f"{self.name}: {self.cases} cases, {self.detected} detected (refused, nothing "
                f"changed), {self.previous} loaded the previous checkpoint, {self.new} the new "
                f"one bitwise; loaded wrong values {len(self.wrong)}, changed before refusing "
                f"{len(self.changed)}")  # fmt: skip

    def check(self) -> None:
        print(self)
        assert not self.wrong, self.wrong[:5]
        assert not self.changed, self.changed[:5]


def try_load(counts: Counts, case: str, path: str, expected: dict[str, list]) -> str:
    """Load ``path`` into a fresh optimizer and model (trained elsewhere: another state) and
    count the outcome; returns it ("refused", or the key of ``expected`` that loaded)."""
    counts.cases += 1
    m, opt = trained(seed=7, steps=1)
    before = snapshot(m, opt)
    try:
        opt.load_streamed(path, model=m)
    except ValueError:
        if not same(snapshot(m, opt), before):
            counts.changed.append(case)
        opt.state_dict()  # not left refusing
        counts.detected += 1
        opt.close()
        return "refused"
    got = snapshot(m, opt)
    opt.close()
    for key, want in expected.items():
        if same(got, want):
            setattr(counts, key, getattr(counts, key) + 1)
            return key
    counts.wrong.append(case)
    return "wrong"


def damage(rng: random.Random, file: str, kind: str) -> None:
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        if kind == "flip":
            at = rng.randrange(size)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ rng.randrange(1, 256)]))
        elif kind == "overwrite64":  # 64 bytes in the middle, as the second step
            f.seek(max(size // 2 - 32, 0))
            f.write(bytes(rng.randrange(256) for _ in range(64)))
        elif kind == "truncate":
            f.truncate(rng.randrange(size))
    if kind == "delete":
        os.remove(file)


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(streamed, "PART_NBYTES", 2048)  # a dozen parts


def test_damaged_streamed_checkpoints_are_refused_before_anything_changes(tmp_path, small_parts):
    rng = random.Random(44)
    m, opt = trained(seed=0, steps=3)
    pristine = str(tmp_path / "pristine")
    opt.save_streamed(pristine, model=m, extra={"step": 3})
    want = {"new": snapshot(m, opt)}
    opt.close()
    files = sorted(os.listdir(pristine))
    assert len(files) > 8, files
    counts = Counts("streamed checkpoint, damaged")
    plan = [("flip", 60), ("overwrite64", 16), ("truncate", 16), ("delete", len(files))]
    for kind, n in plan:
        for i in range(n):
            path = str(tmp_path / f"{kind}-{i}")
            shutil.copytree(pristine, path)
            name = files[i] if kind == "delete" else rng.choice(files)
            damage(rng, os.path.join(path, name), kind)
            outcome = try_load(counts, f"{kind} {name}", path, want)
            if kind != "flip":  # a flip may land where nothing reads (a zip's padding)
                assert outcome == "refused", (kind, name)
            shutil.rmtree(path)
    counts.check()
    assert counts.detected >= counts.cases - 6  # nearly every flip is found


def test_damaged_save_files_are_refused(tmp_path):
    """The main job's ``--save`` file: the same damage, read by ``--resume``'s loader."""
    rng = random.Random(45)
    m, opt = trained(seed=0, steps=2)
    cfg = TrainConfig(steps=10).resolved()
    pristine = str(tmp_path / "ck.pt")
    save_checkpoint(pristine, cfg, 2, m, opt, torch.Generator(), 5.0)
    sd, weights = opt.state_dict(), m.state_dict()
    want = [t for e in sd["state"].values() for _, t in sorted(e.items())] + list(weights.values())
    opt.close()
    counts = Counts("--save file, damaged")
    for kind, n in (("flip", 40), ("overwrite64", 10), ("truncate", 10), ("delete", 1)):
        for i in range(n):
            path = str(tmp_path / f"{kind}-{i}.pt")
            shutil.copy(pristine, path)
            damage(rng, path, kind)
            counts.cases += 1
            try:
                ck = load_checkpoint(path, cfg)
            except checks.UsageError:
                counts.detected += 1
                continue
            got = [t for e in ck["optimizer"]["state"].values() for _, t in sorted(e.items())]
            if same(got + list(ck["model"].values()), want) and ck["step"] == 2:
                counts.new += 1
            else:
                counts.wrong.append(f"{kind} {i}")
    counts.check()
    assert counts.detected >= counts.cases - 4


class Killed(BaseException):
    """SIGKILL at a step of a save: what the folder holds then is copied before it is raised,
    so the save's clean-up (which a real kill never runs) does not count."""


def _copy_as_killed(work: str, into: str) -> None:
    """``work`` as a kill now would leave it, under ``into``, the saving process gone: its
    temporary folders are named after a process that no longer runs."""
    shutil.copytree(work, into, symlinks=True)
    for entry in os.listdir(into):
        if f".{os.getpid()}." in entry:
            os.rename(os.path.join(into, entry),
                      os.path.join(into, entry.replace(f".{os.getpid()}.", f".{DEAD}.")))  # fmt: skip


def test_a_save_killed_at_any_step_leaves_the_previous_or_the_new_checkpoint(
    tmp_path, small_parts, monkeypatch
):
    m, opt = trained(seed=0, steps=2)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    opt.save_streamed(str(pristine / "ck"), model=m, extra="previous")
    previous = snapshot(m, opt)
    more(m, opt, 1, seed=0)
    new = snapshot(m, opt)
    events: list[str] = []
    kill_at: list[tuple[int, str]] = []  # (event number, "before" or "mid")

    def event(name: str, mid_file: str | None = None) -> None:
        if mid_file is None:
            events.append(name)
        for n, how in kill_at:
            if n == len(events) - 1 and (how == "before") == (mid_file is None):
                if mid_file is not None:  # half of the file on the disk
                    with open(mid_file, "r+b") as f:
                        f.truncate(os.path.getsize(mid_file) // 2)
                _copy_as_killed(str(work), str(tmp_path / f"killed-{n}-{how}"))
                raise Killed

    real_save, real_replace, real_rmtree = streamed.fsync_save, os.replace, shutil.rmtree
    real_fsync_dir = integrity.fsync_dir

    def fsync_save(obj, file):
        event(f"write {os.path.basename(file)}")
        out = real_save(obj, file)
        event(f"write {os.path.basename(file)}", mid_file=file)
        return out

    def replace(a, b):
        event(f"rename {os.path.basename(a)} -> {os.path.basename(b)}")
        return real_replace(a, b)

    def rmtree(p, **kw):
        event(f"remove {os.path.basename(p)}")
        return real_rmtree(p, **kw)

    def fsync_dir(p):
        event(f"flush folder {os.path.basename(p)}")
        return real_fsync_dir(p)

    monkeypatch.setattr(streamed, "fsync_save", fsync_save)
    monkeypatch.setattr(streamed, "os", types.SimpleNamespace(**{**vars(os), "replace": replace}))
    monkeypatch.setattr(streamed, "shutil", types.SimpleNamespace(rmtree=rmtree))
    monkeypatch.setattr(integrity, "fsync_dir", fsync_dir)
    work = tmp_path / "work"
    shutil.copytree(pristine, work)
    opt.save_streamed(str(work / "ck"), model=m, extra="new")  # counts the events
    steps = list(events)
    assert any(e.startswith("rename") for e in steps) and len(steps) > 12, steps
    counts = Counts("streamed save, killed")
    points = [(n, "before") for n in range(len(steps))]
    points += [(n, "mid") for n, e in enumerate(steps) if e.startswith("write")]
    for n, how in points:
        shutil.rmtree(work)
        shutil.copytree(pristine, work)
        events.clear()
        kill_at[:] = [(n, how)]
        with pytest.raises(Killed):
            opt.save_streamed(str(work / "ck"), model=m, extra="new")
        killed = str(tmp_path / f"killed-{n}-{how}" / "ck")
        with monkeypatch.context() as quiet:
            quiet.setattr(leftovers, "warn", lambda message: None)  # the recovery's warning
            outcome = try_load(counts, f"{how} {steps[n]}", killed, {"previous": previous,
                                                                     "new": new})  # fmt: skip
        assert outcome in ("previous", "new"), (how, steps[n], outcome)
    kill_at.clear()
    monkeypatch.undo()
    counts.check()
    # the next save to a killed one's folder cleans up after it
    opt.save_streamed(killed, model=m, extra="again")
    assert sorted(os.listdir(os.path.dirname(killed))) == ["ck"]
    opt.close()


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_space(tmp_path, small_parts,
                                                                       monkeypatch):  # fmt: skip
    rng = random.Random(46)
    m, opt = trained(seed=0, steps=2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m)
    previous = snapshot(m, opt)
    more(m, opt, 1, seed=0)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    real_write = integrity._HashingWriter.write
    counts = Counts("streamed save, disk full")
    for _ in range(12):
        budget = [rng.randrange(total)]

        def write(self, b, budget=budget):
            budget[0] -= len(b)
            if budget[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(self, b)

        monkeypatch.setattr(integrity._HashingWriter, "write", write)
        with pytest.raises(OSError, match=r"disk of .*ck' is full: this checkpoint needs about"):
            opt.save_streamed(path, model=m)
        monkeypatch.setattr(integrity._HashingWriter, "write", real_write)
        assert os.listdir(tmp_path) == ["ck"]  # no temporary folder left
        assert try_load(counts, f"ENOSPC {budget}", path, {"previous": previous}) == "previous"
    counts.check()
    cfg = TrainConfig(steps=10).resolved()  # the --save file too
    file = str(tmp_path / "file.pt")
    save_checkpoint(file, cfg, 2, m, opt, torch.Generator(), 5.0)
    monkeypatch.setattr(integrity._HashingWriter, "write", write)
    budget[0] = 1000
    with pytest.raises(
        OSError, match=r"--save: the disk of .*file.pt' is full.*previous checkpoint"
    ):
        save_checkpoint(file, cfg, 3, m, opt, torch.Generator(), 5.0)
    monkeypatch.undo()
    assert load_checkpoint(file, cfg)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ck", "file.pt"]
    opt.close()


def test_a_full_tmpfs(tmp_path):
    """A real full disk: a 2 MiB tmpfs (root only; skipped where it cannot be mounted)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                         capture_output=True)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"no tmpfs here: {run.stderr.decode().strip()}")
    try:
        torch.manual_seed(0)
        m = torch.nn.Linear(256, 512)  # 0.5 MB of fp32 weights, 1.5 MB of state with them
        opt = HybridAdamW(m.parameters(), offload_fraction=1.0, min_offload_numel=1)
        m(torch.ones(2, 256)).sum().backward()
        opt.step()
        path = str(mount / "ck")
        opt.save_streamed(path)  # the state alone: about 1 MB; with the weights, 1.5 more
        previous = snapshot(m, opt)
        m(torch.ones(2, 256)).sum().backward()
        opt.step()
        with pytest.raises(OSError, match=r"disk of .*ck' is full: this checkpoint needs about"):
            opt.save_streamed(path, model=m)
        assert os.listdir(mount) == ["ck"]
        m2 = torch.nn.Linear(256, 512)
        o2 = HybridAdamW(m2.parameters(), offload_fraction=1.0, min_offload_numel=1)
        o2.load_streamed(path)
        assert same(snapshot(m2, o2)[2:], previous[2:])  # the optimizer's state
        for o in (opt, o2):
            o.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_checkpoints_of_an_offloadopt_before_checksums_still_load_with_one_warning(tmp_path):
    """Version 1 (no checksums): a streamed folder and a --save file load as before, bitwise,
    and say once that their bytes cannot be verified; a version 2 file whose checksum is gone
    is damaged, not old."""
    m, opt = trained(seed=0, steps=2)
    path = str(tmp_path / "ck")
    opt.save_streamed(path, model=m, extra="old")
    want = snapshot(m, opt)
    # rewritten as torch.save wrote them before: no checksums, the index last (the sizes)
    for name in sorted(os.listdir(path), key=lambda n: n == "index.pt"):
        file = os.path.join(path, name)
        obj = torch.load(file, weights_only=True)
        if name == "index.pt":
            obj = {k: v for k, v in obj.items() if k not in ("checksum", "part_checksums")}
            parts = sorted(f for f in os.listdir(path) if f.startswith("part-"))
            obj.update(version=1, part_nbytes=[os.path.getsize(f"{path}/{f}") for f in parts])
        torch.save(obj, file)
    counts = Counts("version 1 streamed checkpoint")
    with pytest.warns(UserWarning, match="before checksums") as said:
        assert try_load(counts, "v1", path, {"new": want}) == "new"
        assert try_load(counts, "v1 again", path, {"new": want}) == "new"
    assert len([w for w in said if "before checksums" in str(w.message)]) == 1
    cfg = TrainConfig(steps=10).resolved()
    file = str(tmp_path / "ck.pt")
    save_checkpoint(file, cfg, 2, m, opt, torch.Generator(), 5.0)
    ck = torch.load(file, weights_only=True)
    torch.save({**ck, "version": 1}, file)
    with pytest.warns(UserWarning, match="before checksums"):
        assert load_checkpoint(file, cfg)["step"] == 2
    torch.save(ck, file)  # version 2 without its checksum
    with pytest.raises(checks.UsageError, match="is damaged: a version 2 checkpoint ends with"):
        load_checkpoint(file, cfg)
    opt.close()


def test_a_byte_of_the_checksum_itself_damaged_is_named_so(tmp_path):
    """A new user's find: a flipped byte inside the stored checksum was printed raw as the
    digest "written" (``xxh3_64 45fa2aaacdcfae"4 written``); it now says the checksum at the
    file's end is no digest."""
    path = tmp_path / "x.pt"
    integrity.fsync_save({"w": torch.arange(10.0)}, str(path))
    algorithm, stored, computed = integrity.checksum_of(str(path))
    assert algorithm == integrity.ALGORITHM and stored == computed
    data = bytearray(path.read_bytes())
    data[data.rindex(stored.encode()) + 14] = ord('"')
    path.write_bytes(bytes(data))
    with pytest.raises(integrity.Damaged, match="the checksum written at its end at save is no "
                       "xxh3_64 digest .*; its bytes cannot be verified"):  # fmt: skip
        integrity.verify(str(path), "x.pt")
