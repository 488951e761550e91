"""torch's optimizer test database (``torch.testing._internal.common_optimizers.optim_db``),
imported for tests/test_conformance.py (its inputs) and tests/test_torch_errors.py (its error
inputs) with the process left as it was."""

from __future__ import annotations

import contextlib

import torch


def import_optim_db():
    """torch's optim_db, with the process as it was before the import: the module it imports,
    torch.testing._internal.common_utils, freezes torch.backends flags (assigning, say,
    ``torch.backends.cudnn.benchmark`` raises afterwards), loads a hypothesis profile of its own
    (derandomized, 50 examples, when ``CI`` is set) and wraps TorchScript calls, for every test
    of the session."""
    try:
        import hypothesis
    except ImportError:
        hypothesis = None
    saved = hypothesis.settings.default if hypothesis else None
    calls = torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__
    unfreeze = getattr(torch.backends, "__allow_nonbracketed_mutation", None)
    keep_flags = unfreeze is not None and not torch.backends.flags_frozen()
    with unfreeze() if keep_flags else contextlib.nullcontext():
        from torch.testing._internal.common_optimizers import optim_db
    torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = calls
    if saved is not None:
        hypothesis.settings.register_profile("offloadopt-before-torch-testing", parent=saved)
        hypothesis.settings.load_profile("offloadopt-before-torch-testing")
    return optim_db
