"""The rule book's binding: ``RULES`` (every rule by name), the ``@rule`` that registers one,
``LayoutError`` and ``rule_of``; the rules themselves are this package's other modules, one per
part of a layout."""

from __future__ import annotations

from typing import Callable

from threefold.config import ConfigError

RULES: dict[str, Callable] = {}


class LayoutError(ConfigError):
    """A layout the rule book refuses: one line naming the field and the fix."""


def rule(fn: Callable) -> Callable:
    """Register ``fn`` in ``RULES`` (unchanged: the planner calls rules a million times)."""
    RULES[fn.__name__] = fn
    return fn


def rule_of(error: BaseException) -> str:
    """The name of the rule that raised ``error`` (the innermost rule in its traceback), or
    its message when no rule did."""
    name, tb = str(error), error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if RULES.get(code.co_name) is not None and RULES[code.co_name].__code__ is code:
            name = code.co_name
        tb = tb.tb_next
    return name


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def listed(values) -> str:
    return ", ".join(map(str, values))


