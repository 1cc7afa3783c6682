"""The shape of the code, kept by a test so that every change keeps it: no file in threefold/
over 450 lines, no function over 60 (from its ``def`` to its last line, docstring included),
and the training loop never probes a layout or task with ``getattr(..., default)`` (their
interfaces are declared: ``threefold.parallel.layout.World``, ``threefold.task.Task``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "threefold"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_over_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_the_limit():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_loop_does_not_probe_layouts_or_tasks():
    probe = re.compile(r"getattr\(\s*(lay|layout|run\.layout|self\.run\.layout|task|run\.task)"
                       r"\s*,\s*\"[a-z_]+\"\s*,")
    found = {str(p.relative_to(PACKAGE)): probe.findall(p.read_text()) for p in _sources()}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"getattr probing of a layout or task: {found}"
