"""offloadopt: a hybrid CPU/GPU AdamW that keeps a chosen fraction of the optimizer state and
fp32 master weights in pinned host memory and overlaps the copies with the GPU's work.

The public names below are imported when first used (PEP 562), so that ``import offloadopt``
and the command line's ``--help`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module it is imported from (audit re-exports summarize and
# PageableCopyError from trace_summary)
_LAZY = {
    "HybridAdamW": "offloadopt.adamw",
    "HybridAdam": "offloadopt.adam",
    "HybridSGD": "offloadopt.sgd",
    "HybridDeviceOptimizer": "offloadopt.compat.megatron",
    "HybridOptimizer": "offloadopt.optim",
    "PinnedAllocationError": "offloadopt.link.host",
    "PageableCopyError": "offloadopt.audit",
    "Placement": "offloadopt.place.placement",
    "audit": "offloadopt.audit",
    "check_pinned": "offloadopt.audit",
    "summarize": "offloadopt.audit",
}

__all__ = [
    "HybridAdamW",
    "HybridAdam",
    "HybridSGD",
    "HybridDeviceOptimizer",
    "HybridOptimizer",
    "PinnedAllocationError",
    "PageableCopyError",
    "Placement",
    "audit",
    "check_pinned",
    "summarize",
    "__version__",
]

if TYPE_CHECKING:
    from offloadopt.adam import HybridAdam
    from offloadopt.adamw import HybridAdamW
    from offloadopt.audit import PageableCopyError, audit, check_pinned, summarize
    from offloadopt.compat.megatron import HybridDeviceOptimizer
    from offloadopt.link.host import PinnedAllocationError
    from offloadopt.optim import HybridOptimizer
    from offloadopt.place.placement import Placement
    from offloadopt.sgd import HybridSGD


class _Package(types.ModuleType):
    """The package's module type: ``offloadopt.audit`` stays the function ``audit`` even after
    the submodule of that name is imported (importing a submodule sets the package attribute
    of its name to the module; the eager ``from offloadopt.audit import audit`` this replaces
    had left the function there)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the submodule stays reachable through sys.modules and import statements
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'offloadopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # found here from now on, without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


sys.modules[__name__].__class__ = _Package
