"""Every config field with its default and its one-line docstring, in declaration order, for
``gspo train --help`` and the docs test. It reads the models; it formats nothing."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from gspo.config.base import Section
from gspo.config.train import TrainConfig


def _section(annotation) -> tuple[type[Section] | None, str]:
    """The Section inside ``annotation`` (``X``, ``X | None``, ``list[X]``) and the key suffix
    that reaches its fields ('' or '[]')."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, ""
    args = typing.get_args(annotation)
    inner = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    if not inner:
        return None, ""
    return inner[0], "[]" if typing.get_origin(annotation) is list else ""


def _default(info) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return ""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def field_docs(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as text, docstring) of every leaf field under ``model``; a list of
    sections is walked as ``key[].field`` (e.g. ``rewards.sources[].type``)."""
    rows = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        inner, suffix = _section(info.annotation)
        if inner is None:
            rows.append((key, _default(info), info.description or ""))
        else:
            if prefix and info.description:  # a nested section's own line (model.lora=null)
                rows.append((key, _default(info), info.description))
            rows += field_docs(inner, f"{key}{suffix}.")
    return rows


def section_docs(model: type[BaseModel] = TrainConfig) -> dict[str, str]:
    """Top-level section name -> its docstring under ``TrainConfig`` (or its class's first line)."""
    out = {}
    for name, info in model.model_fields.items():
        inner, _ = _section(info.annotation)
        if inner is not None:
            doc = info.description or (inner.__doc__ or "").strip().split("\n")[0]
            out[info.alias or name] = doc
    return out
