"""griffe extension for the API page (mkdocs.yml loads it): the hybrid optimizers take
``**options: Unpack[OffloadOptions]``, which mkdocstrings would show as one parameter with no
type, and each option documented under ``Args:`` as required with no type. This replaces that
parameter in their signatures by the keyword-only options themselves, each with the type and
default that ``offloadopt.options.Options`` declares (the one place they are declared).
tests/test_api_page.py checks the built page."""

from __future__ import annotations

from typing import Any

import griffe

from offloadopt.options import describe


def option_parameters() -> list[griffe.Parameter]:
    """The public options as keyword-only parameters (``offloadopt.options.describe``)."""
    return [griffe.Parameter(name, annotation=kind, kind=griffe.ParameterKind.keyword_only,
                             default=default) for name, kind, default, _ in describe()]  # fmt: skip


class OptionsSignature(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.name != "__init__":
            return
        params = list(func.parameters)
        keep = [p for p in params if not (p.kind is griffe.ParameterKind.var_keyword
                                          and "OffloadOptions" in str(p.annotation))]  # fmt: skip
        if len(keep) < len(params):
            func.parameters = griffe.Parameters(*keep, *option_parameters())
