"""Optional dependencies, imported when first needed: a missing one is a one-line UserError that
says how to install it, and an installed one costs no start-up time until it is used (datasets
and math-verify take seconds to import)."""

from __future__ import annotations

import importlib
from types import ModuleType

from gspo.errors import UserError

EXTRA = {"datasets": "data", "math_verify": "data", "reasoning_gym": "reasoning-gym", "verifiers": "verifiers",
         "verifiers.v1": "verifiers-v1", "openai": "verifiers"}  # module -> the pip extra that installs it
PACKAGE = {"math_verify": "math-verify", "reasoning_gym": "reasoning-gym", "verifiers.v1": "verifiers"}


def require(module: str, purpose: str) -> ModuleType:
    """``import module``, or UserError naming ``purpose`` and the install command. Only the
    modules of ``EXTRA`` (a fixed table, never a name from user input)."""
    if module not in EXTRA:
        raise ValueError(f"gspo.optional knows no optional module {module!r}")
    try:
        return importlib.import_module(module)
    except ImportError:
        package = PACKAGE.get(module, module)
        extra = EXTRA.get(module)
        how = f"pip install 'gspo[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        raise UserError(f"{purpose} needs the {package} package: {how}") from None
