"""offloadopt: a hybrid CPU/GPU AdamW that keeps a chosen fraction of the optimizer state and
fp32 master weights in pinned host memory and overlaps the copies with the GPU's work."""

from offloadopt.adam import HybridAdam
from offloadopt.adamw import HybridAdamW
from offloadopt.audit import PageableCopyError, audit, check_pinned, summarize
from offloadopt.compat.megatron import HybridDeviceOptimizer
from offloadopt.host import PinnedAllocationError
from offloadopt.optim import HybridOptimizer
from offloadopt.placement import Placement
from offloadopt.sgd import HybridSGD

__version__ = "0.1.0"

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
