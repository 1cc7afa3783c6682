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


# --------------------------------------------------------------------------------------------
# Parallelisms change a module one way: into a wrapper class (threefold.parallel.wrap.become)
# --------------------------------------------------------------------------------------------
_REPLACED_METHODS = ("attend", "attention_mask", "dispatch", "forward")


def _instance_patches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of every ``<obj>.<attr> = ...`` (or ``setattr(obj, "attr", ...)``) that
    patches an instance: the value a lambda, a function defined in the file or bound with
    ``MethodType``, or the attribute one of the methods wrappers override. ``self.x = ...``
    (a class setting its own state) is not one."""
    defs = {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def patching(value: ast.AST) -> bool:
        if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in defs):
            return True
        f = value.func if isinstance(value, ast.Call) else None
        return isinstance(f, (ast.Name, ast.Attribute)) and \
            (f.id if isinstance(f, ast.Name) else f.attr) == "MethodType"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if not isinstance(tt, ast.Attribute) or \
                            (isinstance(tt.value, ast.Name) and tt.value.id == "self"):
                        continue
                    if tt.attr in _REPLACED_METHODS or (node.value is not None
                                                        and patching(node.value)):
                        found.append((node.lineno, ast.unparse(tt)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "setattr" and len(node.args) == 3:
            name = node.args[1]
            if (isinstance(name, ast.Constant) and name.value in _REPLACED_METHODS) or \
                    patching(node.args[2]):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_parallelisms_do_not_patch_instances():
    """No code in threefold/parallel/ sets a function on a module instance or replaces one of
    the methods wrappers override from outside: a parallelism turns the module into its
    wrapper class (``threefold.parallel.wrap.become``), which ``print(model)`` shows."""
    found = {}
    for p in sorted((PACKAGE / "parallel").rglob("*.py")):
        hits = _instance_patches(ast.parse(p.read_text()))
        if hits:
            found[str(p.relative_to(PACKAGE))] = hits
    assert not found, f"instance patching (use a wrapper class and wrap.become): {found}"
    # the scan itself finds what it is for, and passes what is fine
    bad = ("def attend(q):\n    pass\n"
           "def f(model, comm):\n    model.layer.attend = attend\n"
           "    mod.attention_mask = lambda d: d\n    m.dispatch = Dispatcher(comm)\n"
           "    setattr(m, 'forward', g)\n    m.run = types.MethodType(g, m)\n")
    assert [line for line, _ in _instance_patches(ast.parse(bad))] == [4, 5, 6, 7, 8]
    fine = ("class A:\n    def __init__(self, f):\n        self.attend = f\n"
            "        self.g = lambda x: x\n"
            "def f(module, p, w):\n    p.data = w\n    module.weight = w\n"
            "    module.__class__ = A\n    ctx.comm, ctx.scale = 1, 2\n")
    assert _instance_patches(ast.parse(fine)) == []
