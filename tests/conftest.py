"""Test setup, one mechanism: every test under tests/cuda/ (or marked ``cuda``) carries the
``cuda`` marker and is skipped when torch sees no GPU, so CI runs the rest and the GPU host
runs ``pytest -m cuda``. Seeds are fixed per test. Every child Python a test starts imports
this checkout's offloadopt, as the tests themselves do (pyproject.toml's ``pythonpath``)."""

import os
from pathlib import Path

import pytest
import torch

_CUDA_DIR = Path(__file__).parent / "cuda"
_ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/cuda run on the GPU host)")
    for item in items:
        if _CUDA_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cuda)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _children_import_this_checkout():
    """This checkout first on PYTHONPATH, which every child Python inherits (``python -m
    offloadopt``, ``python -c``, a script of benchmarks/ or examples/, torchrun's ranks; a
    child given its own environment copies ``os.environ``). Without it a child whose path
    held no checkout (started from a tmp folder, or with a script's folder first) imported the
    offloadopt installed in the venv: under a venv shared by clones, another clone's code
    (tests/test_package.py, test_every_child_python_imports_this_checkout)."""
    with pytest.MonkeyPatch.context() as patch:
        inherited = os.environ.get("PYTHONPATH")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(_ROOT), inherited])))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _dynamo_counters_cleared():
    """Each test as in a fresh process for wait="module": a torch.compile in this process
    makes step() wait for every copy back (offloadopt/step/hooks.py, dynamo_compiled_any,
    which reads dynamo's counters), so one test's compile would change a later test's
    overlap. Clears the counters (not the compiled caches)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.utils.counters.clear()
    yield


@pytest.fixture
def ctrl_c_raises():
    """Python's Ctrl-C handler for a test that raises SIGINT, whatever the process inherited: a
    shell starts background jobs with SIGINT ignored, and Python then leaves it so (such a test
    then saw no KeyboardInterrupt)."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
