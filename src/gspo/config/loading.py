"""Loading: YAML files plus dotted ``key=value`` overrides -> a validated, resolved
``TrainConfig``, with one-line errors; the one YAML writer; the cold-start cache's config hash.

``load_config`` validates each section (pydantic), then resolves the rules across sections
(``gspo.config.resolve``) against this process's ``Environment``; every refusal is one
``ConfigError`` line that starts with the config's source (its file, or ``config``)."""

from __future__ import annotations

import difflib
import hashlib
import json
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gspo import objective_presets as presets
from gspo.config.base import ConfigError
from gspo.config.resolve import Environment, resolve
from gspo.config.train import TrainConfig
from gspo.storage import write_atomic


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.steps=5' -> (['train', 'steps'], 5); values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    return key.split("."), value


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """Valid keys at the location of an error (for the "did you mean")."""
    for part in loc[:-1]:
        if isinstance(part, int):  # an index into a list section, e.g. rewards[0]
            continue
        ann = getattr(model.model_fields.get(part), "annotation", None)
        args = typing.get_args(ann)
        if typing.get_origin(ann) is list and args:
            ann = args[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or name for name, f in model.model_fields.items()]  # rollout.async, not async_


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc) or "<config>"
    if first["type"] == "extra_forbidden":
        names = _field_names(model, loc)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
        return f"{source}: unknown key {key!r}{hint}"
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:
        return f"{source}: {msg}"
    got = first.get("input")
    return f"{source}: {key}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})")


def shipped_config(name: str = "default.yaml") -> Path:
    """A config file inside the installed package (``gspo/configs/<name>``, a byte copy of the
    repository's ``configs/<name>``). ``default.yaml`` is the main job: what ``gspo train``,
    ``gspo sft`` and ``gspo eval`` read when no config file is given, also outside the repository."""
    return Path(str(resources.files("gspo") / "configs" / name))


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                environment: Environment | None = None) -> TrainConfig:
    """Read ``path`` (optional), apply ``key=value`` overrides, validate, resolve against
    ``environment`` (default: this process's). Raises ConfigError.

    An ``objective.preset=NAME`` override is expanded where it stands (gspo.objective_presets.expand)."""
    tree = read_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        apply_override(tree, key, value)
        if key == ["objective", "preset"]:   # its values, here: over the file and earlier overrides
            tree = presets.expand(tree, replace=True)
    source = str(path) if path else "config"
    try:
        config = TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, TrainConfig, source)) from None
    try:
        return resolve(config, environment or Environment.of_process()).config
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None


def config_hash(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (used to cache cold-start checkpoints)."""
    blob = json.dumps([p.model_dump() if isinstance(p, BaseModel) else p for p in parts],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def dump_yaml(config: BaseModel, path: str | Path) -> None:
    """The one YAML writer of a config: atomically (gspo.storage.write_atomic), so a killed run
    never leaves half a config."""
    write_atomic(Path(path), yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
