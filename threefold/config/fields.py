"""What every configuration module shares: ``ConfigError``, the unknown-value message and the
documented dataclass field."""

from __future__ import annotations

import difflib
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value, named by its dotted field path."""


def unknown_value(path: str, key: str, choices) -> str:
    """The message for ``key``, not one of ``choices``, at ``path``: the nearest choice as a
    hint, else every valid one."""
    near = difflib.get_close_matches(str(key), list(choices), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid: {', '.join(map(str, choices))}"
    return f"{path}: unknown value '{key}'{hint}"


def doc_field(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with a one-line doc."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})
