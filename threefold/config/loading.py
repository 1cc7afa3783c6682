"""Building a ``Config``: defaults <- TOML file <- dotted ``--section.key value`` overrides
(overrides win), then ``validate``."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from threefold.config.fields import ConfigError, unknown_value
from threefold.config.schema import Config
from threefold.config.validation import validate


def _coerce(path: str, value: Any, typ: Any) -> Any:
    """Convert a TOML or CLI string value to the field's type, or raise ConfigError."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if args and typing.get_origin(typ) in (typing.Union, types.UnionType):
        if str in args:  # a number or a word (checkpoint.interval: 100 or auto)
            try:
                return _coerce(path, value, args[0])
            except ConfigError:
                return _coerce(path, value, str)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{path}: '{value}' is not a valid {getattr(typ, '__name__', typ)}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{dotted}: options are written section.key, e.g. --train.steps 100")
    section, key = parts
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(unknown_value("config", section, sections).replace("value", "section"))
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if key not in names:
        near = difflib.get_close_matches(key, names, n=1)
        hint = f"; did you mean '{section}.{near[0]}'?" if near else ""
        raise ConfigError(f"{section}.{key}: unknown option{hint}")
    setattr(obj, key, _coerce(dotted, value, hints[key]))


def apply_mapping(cfg: Config, data: dict[str, Any]) -> None:
    """Apply a nested mapping (as read from TOML) onto ``cfg``."""
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {values!r}")
        for key, value in values.items():
            _set(cfg, f"{section}.{key}", value)


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """Turn ['--train.steps', '5', '--x.y=z'] into [('train.steps','5'), ('x.y','z')]."""
    out, i = [], 0
    while i < len(argv):
        if not argv[i].startswith("--"):
            raise ConfigError(f"unexpected argument '{argv[i]}': options are --section.key value")
        key, value, i = take_flag(argv, i)
        out.append((key, value))
    return out


def take_flag(argv: list[str], i: int) -> tuple[str, str, int]:
    """``--a.b value`` or ``--a.b=value`` at ``argv[i]`` -> ('a.b', value, next index);
    dashes in the key become underscores."""
    key = argv[i][2:]
    if "=" in key:
        key, value = key.split("=", 1)
        i += 1
    elif i + 1 < len(argv):
        value, i = argv[i + 1], i + 2
    else:
        raise ConfigError(f"--{key}: missing value")
    return key.replace("-", "_"), value, i


def load_config(path: str | None = None, overrides: list[tuple[str, str]] | None = None,
                validate_now: bool = True) -> Config:
    """Defaults <- TOML file <- overrides; validated unless ``validate_now`` is False."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
        apply_mapping(cfg, data)
    for key, value in overrides or []:
        _set(cfg, key, value)
    if validate_now:
        validate(cfg)
    return cfg
