"""The package's layers (docs/how-it-works.md, "The repository"): the optimizer -> step/ ->
place/ -> state/ and link/, stacked one way, and no import cycle between modules. Imports are
read from the source (module level and inside functions alike), so a lazy import that goes up a
layer fails here too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import offloadopt

ROOT = Path(offloadopt.__file__).parent
# What each folder may import from the package, besides itself and the leaf modules.
ALLOWED = {
    "link": set(),
    "state": {"link"},
    "place": {"link", "state"},
    "step": {"link", "state", "place"},
}
LEAVES = {"rules", "options", "shards", "warn", "interrupts", "validation", "kernels"}
# leaf packages: every layer may import them; they import nothing of the package but themselves
LEAF_PACKAGES = {"kernels"}


def imports() -> dict[str, set[str]]:
    """module -> the offloadopt modules it imports (dotted names, package-relative)."""
    out: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("offloadopt."):
                    rel = name.removeprefix("offloadopt.")
                    # the longest prefix that is a module of the package
                    parts = rel.split(".")
                    for k in range(len(parts), 0, -1):
                        cand = ".".join(parts[:k])
                        if (ROOT / Path(*parts[:k])).with_suffix(".py").exists():
                            found.add(cand)
                            break
                        if (ROOT / Path(*parts[:k]) / "__init__.py").exists():
                            found.add(f"{cand}.__init__")
                            break
    return out


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, deps in imports().items():
        folder = mod.split(".")[0] if "." in mod else None
        if folder not in ALLOWED:
            continue
        for dep in deps:
            top = dep.split(".")[0]
            if "." not in dep or top in LEAVES or top == folder:
                ok = "." not in dep and dep in LEAVES or top == folder or top in LEAVES
            else:
                ok = top in ALLOWED[folder]
            if not ok:
                bad.append(f"{mod} imports {dep}")
    assert not bad, bad


def test_the_leaf_modules_import_nothing_of_the_package_but_leaves():
    graph = imports()
    bad = [f"{leaf} imports {dep}" for leaf in LEAVES for dep in graph.get(leaf, ())
           if dep.split(".")[0] not in LEAVES]  # fmt: skip
    assert not bad, bad


def test_the_leaf_packages_import_only_themselves():
    bad = [f"{mod} imports {dep}" for mod, deps in imports().items()
           if mod.split(".")[0] in LEAF_PACKAGES for dep in deps
           if dep.split(".")[0] != mod.split(".")[0]]  # fmt: skip
    assert not bad, bad


def test_no_import_cycle_between_modules():
    graph = imports()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if dep.endswith("__init__") or dep not in graph:
                continue
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep] if dep in path else [mod, dep])
            elif state.get(dep) is None:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if state.get(mod) is None:
            visit(mod, [mod])
    assert not cycles, cycles


def assert_catches(tmp_path, monkeypatch, files: dict[str, str], check, *names: str) -> None:
    """``check`` run over a planted package of ``files`` (path -> source) fails, naming each
    of ``names``: the checks can fail."""
    fake = tmp_path / "offloadopt"
    for rel, source in files.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    try:
        check()
    except AssertionError as e:
        assert all(name in str(e) for name in names), str(e)
    else:
        raise AssertionError(f"{check.__name__} passed a planted package")


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    files = {"link/x.py": "from offloadopt.step.y import z\n", "step/y.py": "z = 1\n"}
    assert_catches(tmp_path, monkeypatch, files, test_each_layer_imports_only_the_layers_below_it,
                   "link.x imports step.y")  # fmt: skip


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    files = {"place/a.py": "from offloadopt.place.b import x\ny = 1\n",
             "place/b.py": "def f():\n    from offloadopt.place.a import y\nx = 1\n"}  # fmt: skip
    assert_catches(tmp_path, monkeypatch, files, test_no_import_cycle_between_modules,
                   "place.a", "place.b")  # fmt: skip


def test_the_leaf_package_check_can_fail(tmp_path, monkeypatch):
    files = {"kernels/__init__.py": "", "kernels/a.py": "from offloadopt.rules import x\n",
             "rules.py": "x = 1\n"}  # fmt: skip
    assert_catches(tmp_path, monkeypatch, files, test_the_leaf_packages_import_only_themselves,
                   "kernels.a imports rules")  # fmt: skip


# No test imports a benchmark: a suite's cases live in tests/ (tests/long/ for the long-running
# ones), and a test of a script of benchmarks/ runs it as a program, through as_program.py (the
# one file here that executes one, as ``python script`` does, in a child process).
AS_PROGRAM = "as_program.py"
LOADS = re.compile(r"spec_from_file_location|sys\.path\.insert|syspath_prepend|run_path")


def test_no_test_imports_a_benchmark():
    tests = Path(__file__).resolve().parent
    benchmarks = {p.stem for p in (tests.parent / "benchmarks").glob("*.py")}
    bad = []
    for path in tests.rglob("*.py"):
        text = path.read_text()
        names = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found = sorted(names & benchmarks - {p.stem for p in tests.glob("*.py")})
        if found:
            bad.append(f"{path.relative_to(tests)} imports {found}")
        elif path.name != AS_PROGRAM and path != Path(__file__).resolve() and \
                LOADS.search(text) and re.search(r"""["']?benchmarks["'/]""", text):  # fmt: skip
            bad.append(f"{path.relative_to(tests)} loads a file of benchmarks/")
    assert not bad, bad
