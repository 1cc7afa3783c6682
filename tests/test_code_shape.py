"""The shape of the code, kept by a test so that every change keeps it: no file in threefold/
over 450 lines, no function over 60 (from its ``def`` to its last line, docstring included),
the training loop never probes a layout or task with ``getattr(..., default)`` (their
interfaces are declared: ``threefold.parallel.world.World``, ``threefold.training.task.Task``,
``threefold.training.run.Engine``), the step branches on no layout or family, the folders are
the layers and imports point down them with no circles (the table is docs/architecture.md's),
no two modules share a name, and every name has one import path."""

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
    probe = re.compile(r"getattr\(\s*(lay|layout|world|run\.world|self\.run\.world|task|run\.task)"
                       r"\s*,\s*\"[a-z_]+\"\s*,")
    found = {str(p.relative_to(PACKAGE)): probe.findall(p.read_text()) for p in _sources()}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"getattr probing of a layout or task: {found}"


# --------------------------------------------------------------------------------------------
# The training step knows no layout and no model family: it calls the world's, the engine's,
# the task's and the router log's hooks (threefold.training.steps)
# --------------------------------------------------------------------------------------------
_PROBES = ("hasattr", "getattr")
# what a step would read to tell layouts or families apart: the parallel config, the pipeline,
# model-parallel degrees, the model config (its router kind, its experts)
_LAYOUT_OR_FAMILY = ("parallel", "pipeline", "chunks", "tp_overlap", "ep_size", "tp_size",
                     "cp_size", "model_cfg", "moe_router", "num_local_experts")
_LAYOUT_OR_FAMILY_MODULES = ("threefold.parallel", "threefold.model.moe", "threefold.families",
                             "threefold.comm.mesh")


def _layout_or_family_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every probe call (``hasattr``, ``getattr``), read of an attribute that
    names a layout or a model family, and import of a layout's or a family's module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in _PROBES:
            found.append((node.lineno, f"{node.func.id}()"))
        elif isinstance(node, ast.Attribute) and node.attr in _LAYOUT_OR_FAMILY:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            found += [(node.lineno, f"import {n}") for n in names
                      if any(n == m or n.startswith(m + ".") for m in _LAYOUT_OR_FAMILY_MODULES)]
    return sorted(found)


def test_the_step_branches_on_no_layout_or_family():
    """threefold.training.steps reads no layout (the parallel config, the pipeline, a degree) and no
    model family (the router kind, the experts), probes nothing with ``hasattr``/``getattr``
    and imports no parallelism or family: what differs is behind declared hooks
    (``World.traced``/``forward_backward``/``forward_only``, ``Engine.begin_step``/
    ``step_metrics``, ``RouterLog``)."""
    hits = _layout_or_family_reads(ast.parse((PACKAGE / "training" / "steps.py").read_text()))
    assert not hits, f"threefold/training/steps.py names a layout or a family: {hits}"
    # the scan itself finds what it is for, and passes what is fine
    bad = ("from threefold.parallel.transforms.expert import take_rows_sent\n"
           "import threefold.model.moe\n"
           "def step(run, eng, lay):\n"
           "    if hasattr(eng, 'comm_trace'):\n"
           "        pass\n"
           "    x = run.cfg.parallel.tp_overlap\n"
           "    if lay.pipeline is not None or lay.ep_size > 1:\n"
           "        pass\n"
           "    if run.model_cfg.moe_router == 'sigmoid_grouped':\n"
           "        getattr(lay, 'chunks', None)\n")
    assert sorted({line for line, _ in _layout_or_family_reads(ast.parse(bad))}) == \
        [1, 2, 4, 6, 7, 9, 10]
    fine = ("from threefold.config import Config\n"
            "def step(run, lay, eng):\n"
            "    lay.forward_backward(run.micro, run.cfg.train.steps, None, None)\n"
            "    eng.step_metrics()\n    run.router_log.balance(lay.sum_logged)\n")
    assert _layout_or_family_reads(ast.parse(fine)) == []


# --------------------------------------------------------------------------------------------
# Parallelisms change a module one way: into a wrapper class
# (threefold.parallel.transforms.wrap.become)
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
    wrapper class (``threefold.parallel.transforms.wrap.become``), which ``print(model)`` shows."""
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


# --------------------------------------------------------------------------------------------
# Imports point down. A room is a folder of threefold/ (with everything under it), plus
# __main__.py; the folders read top to bottom are the layers, from the command line down to
# config/, which imports nothing of threefold. A room may import rooms of its own layer or of a
# layer below. docs/architecture.md's table of rooms is this table.
# --------------------------------------------------------------------------------------------

LAYERS = [
    ["__main__", "commands"],
    ["launch"],
    ["post"],
    ["training"],
    ["generation"],
    ["parallel"],
    ["plan"],
    ["weights"],
    ["accounting"],
    ["comm"],
    ["model"],
    ["layout"],
    ["families", "schedules", "hardware", "data"],
    ["config"],
]

# Arrows that still point up, each in files outside the change that made this table; the test
# below fails once one is gone, so that the entry goes too. The cycle checks leave them out.
ALLOWED_UPWARD = {
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in _sources()}


def _resolve(name: str) -> str | None:
    """The module of threefold that ``name`` (a module, or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(path: Path, module: str) -> set[str]:
    """The modules of threefold that ``path`` imports anywhere: at the top, inside functions
    (lazy) and under ``if TYPE_CHECKING:``."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # from a package import its modules: those modules, else the package itself
            out |= {_resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in MODULES
                    else _resolve(base) for a in node.names}
    return {m for m in out if m and m != module and m != "threefold"}


FILE_IMPORTS = {m: _imported(p, m) for m, p in MODULES.items()}


def _room(module: str) -> str:
    return module.split(".")[1]


def _room_imports() -> dict[tuple[str, str], list[str]]:
    """(importer room, imported room) -> the file imports ("a -> b") behind that arrow."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for m, targets in FILE_IMPORTS.items():
        if m == "threefold":
            continue
        for t in targets:
            if _room(m) != _room(t):
                arrows.setdefault((_room(m), _room(t)), []).append(f"{m} -> {t}")
    return arrows


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def _layer_of() -> dict[str, int]:
    return {room: i for i, layer in enumerate(LAYERS) for room in layer}


def test_the_rooms_are_folders():
    """threefold/ holds folders and its entry points only: a new module goes in the folder of
    its layer."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], f"modules outside a folder: {loose}"


def test_every_room_has_one_layer():
    rooms = {_room(m) for m in MODULES if m != "threefold"}
    listed = [room for layer in LAYERS for room in layer]
    assert len(listed) == len(set(listed)), "a room in two layers"
    assert rooms == set(listed), (f"rooms missing from LAYERS: {sorted(rooms - set(listed))}; "
                                  f"listed but absent: {sorted(set(listed) - rooms)}")


def test_imports_point_down():
    layer = _layer_of()
    up = {arrow: files for arrow, files in _room_imports().items()
          if layer[arrow[0]] > layer[arrow[1]] and arrow not in ALLOWED_UPWARD}
    assert not up, "imports that point up the layer table:\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(sorted(files))}" for (a, b), files in sorted(up.items()))


def test_allowed_upward_arrows_are_still_there():
    layer, arrows = _layer_of(), _room_imports()
    gone = [arrow for arrow in ALLOWED_UPWARD
            if arrow not in arrows or layer[arrow[0]] <= layer[arrow[1]]]
    assert not gone, f"fixed, so take them out of ALLOWED_UPWARD: {gone}"


def test_no_import_cycles_among_rooms():
    graph: dict[str, set[str]] = {}
    for a, b in _room_imports():
        if (a, b) not in ALLOWED_UPWARD:
            graph.setdefault(a, set()).add(b)
    cycle = _find_cycle(graph)
    assert cycle is None, "rooms import each other: " + " -> ".join(cycle)


def test_no_import_cycles_among_files():
    graph = {m: {t for t in targets if (_room(m), _room(t)) not in ALLOWED_UPWARD}
             for m, targets in FILE_IMPORTS.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle)


def test_engines_meet_the_engine_protocol():
    """Each engine of threefold.parallel has every method of ``threefold.training.run.Engine`` (the
    interface the loop, the layouts and the checkpoints use), with the same parameters."""
    import inspect

    from threefold.parallel.engines.data_parallel import DataParallelEngine
    from threefold.parallel.engines.engine import LocalEngine
    from threefold.parallel.engines.zero import ZeroEngine
    from threefold.training.run import Engine

    wanted = {name: list(inspect.signature(f).parameters) for name, f in vars(Engine).items()
              if inspect.isfunction(f) and not name.startswith("_")}
    assert "micro_step" in wanted and "load_from" in wanted
    for cls in (LocalEngine, DataParallelEngine, ZeroEngine):
        have = {name: list(inspect.signature(getattr(cls, name)).parameters)
                for name in wanted if hasattr(cls, name)}
        assert have == wanted, f"{cls.__name__} differs from threefold.training.run.Engine"


def test_the_architecture_page_lists_the_same_layers():
    """docs/architecture.md's table of rooms, row by row, is ``LAYERS``."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text().splitlines()
    start = doc.index("| rooms (top to bottom) | own |") + 2
    rows = []
    for line in doc[start:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        rows.append([re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", cell)])
    assert rows == LAYERS


# --------------------------------------------------------------------------------------------
# One name, one place: no two modules share a file name, and every name of threefold is
# imported through one path: the module that defines it, or the package whose __init__ gathers
# it (a facade), never both.
# --------------------------------------------------------------------------------------------

def test_no_module_name_repeats():
    stems: dict[str, list[str]] = {}
    for p in _sources():
        if p.stem not in ("__init__", "__main__"):
            stems.setdefault(p.stem, []).append(str(p.relative_to(PACKAGE)))
    packages = {p.parent.name for p in _sources() if p.name == "__init__.py"} - {"threefold"}
    repeated = {s: ps for s, ps in stems.items() if len(ps) > 1 or s in packages}
    assert not repeated, f"module names used twice (or as a package's): {repeated}"


def _defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (classes, functions, assignments), not those it
    imports."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


DEFINED = {m: _defined_names(p) for m, p in MODULES.items()}
FACADES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _name_imports(roots=("threefold", "tests", "bench")):
    """(importing file, module imported from, name) for every ``from threefold... import name``
    of a name that is not a module."""
    root = PACKAGE.parent
    for d in roots:
        for p in sorted((root / d).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] == "threefold" and node.module in MODULES:
                    for a in node.names:
                        if f"{node.module}.{a.name}" not in MODULES:
                            yield str(p.relative_to(root)), node.module, a.name


def _origin(module: str, name: str) -> tuple[str, str]:
    """The module that defines ``name`` as imported from ``module``, following re-imports."""
    for _ in range(10):
        if name in DEFINED[module]:
            break
        src = next((n for n in ast.parse(MODULES[module].read_text()).body
                    if isinstance(n, ast.ImportFrom) and n.module in MODULES
                    and any((a.asname or a.name) == name for a in n.names)), None)
        if src is None:
            break
        name = next(a.name for a in src.names if (a.asname or a.name) == name)
        module = src.module
    return module, name


def test_every_name_has_one_import_path():
    """A name comes from the module that defines it, or from a package that gathers it in its
    __init__; a name a package gathers is not also imported from its defining module outside
    that package; and no plain module passes on a name it imported."""
    gathered = {}  # (defining module, name) -> the package that gathers it
    for f in FACADES:
        for node in ast.parse(MODULES[f].read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module in MODULES:
                for a in node.names:
                    home = _origin(node.module, a.name)
                    if home[0].startswith(f + "."):  # its own modules' names only
                        gathered[home] = f
    wrong = []
    for where, module, name in _name_imports():
        home, real = _origin(module, name)
        facade = gathered.get((home, real))
        inside = facade and where.replace("/", ".").startswith(facade + ".")
        path = facade if facade and not inside else home
        if module != path:
            wrong.append(f"{where}: {name} from {module}; its one path is {path}")
    assert not wrong, "names imported through a second path:\n" + "\n".join(sorted(wrong))


def test_no_module_passes_on_another_packages_names():
    """``__all__`` lists a module's own names, or, for a package, its own modules' names:
    nothing defined in another package is offered a second path."""
    wrong = []
    for m, p in MODULES.items():
        for node in ast.parse(p.read_text()).body:
            if not (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                continue
            for name in (e.value for e in node.value.elts):
                home, _ = _origin(m, name)
                own = home == m or (m in FACADES and home.startswith(m + "."))
                if not own:
                    wrong.append(f"{m}: {name} (defined in {home})")
    assert not wrong, "names offered through a second path:\n" + "\n".join(wrong)
