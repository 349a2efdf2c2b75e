"""What every config section shares: the one-line ``ConfigError``, ``one_of`` for names checked
against a registry, and ``Section`` (unknown keys refused, a docstring under every field)."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict

from gspo.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in a config file or override: one line, names the key."""


def one_of(kind: str, name: str, valid: list[str]) -> str:
    """``name`` if it is in ``valid``, else ValueError with a "did you mean" and the valid names."""
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown {kind} {name!r}; {hint}valid: {', '.join(valid)}")
    return name


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
