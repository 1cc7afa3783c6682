"""Every rank issues the same collectives in the same order, decided by the configuration alone.

A static check (an AST walk) of the modules that issue collectives or decide what to send:
no loop may run over something whose order depends on the process rather than on the
configuration. Sets (and frozensets) of strings iterate in an order set by the process's hash
seed, sets of objects in one set by their addresses; ``iterdir``/``glob``/``listdir`` follow the
filesystem; a dict keyed by ``id()`` is keyed by addresses. Iterating any of these on a path
that issues collectives is how ranks come to disagree (the MoE start-up deadlock: data
parallelism checked replicas over ``{"dp", "edp"}`` in the order each rank's hash seed gave).

What counts as iterating: a ``for`` loop, a list/dict comprehension or generator, ``list()``,
``tuple()``, ``enumerate()``, ``zip()``, ``map()``, ``iter()``, ``dict.fromkeys()``,
``str.join()``, ``.pop()`` of a set, and ``*`` unpacking. What does not: membership tests,
``len``, ``sorted``, ``min``/``max``, ``any``/``all``, and a set comprehension (whose result is
unordered anyway). ``sorted(...)`` around the expression is the usual fix; ``dict.fromkeys`` of
an ordered sequence is the usual way to drop duplicates in order.

The few places that iterate such a thing on purpose are allowed below, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.dist import run_distributed

ROOT = Path(__file__).resolve().parent.parent / "threefold"

# The modules on a path that issues collectives or decides what a rank sends.
CHECKED = ("comm", "parallel", "weights", "training/train.py", "training/steps.py",
           "training/resume.py", "post", "generation/generate.py")

# (module relative to threefold/, enclosing function) -> why iterating there is safe.
ALLOWED: dict[tuple[str, str], str] = {}

_UNORDERED_CALLS = {"set", "frozenset"}
_SET_METHODS = {"union", "intersection", "difference", "symmetric_difference"}
_LISTING_METHODS = {"iterdir", "glob", "rglob"}
_LISTING_FUNCS = {("os", "listdir"), ("os", "scandir"), ("os", "walk"), ("glob", "glob"),
                  ("glob", "iglob")}
_ITERATING_CALLS = {"list", "tuple", "enumerate", "zip", "map", "iter", "reversed", "filter"}
_ORDER_FREE_CALLS = {"sorted", "set", "frozenset", "len", "min", "max", "any", "all", "sum",
                     "bool"}


def _is_id_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == "id"


class _Scope:
    """Names (locals, and ``self.x`` attributes of the module) bound to unordered values."""

    def __init__(self, parent: "_Scope | None" = None):
        self.names: dict[str, str] = {}
        self.parent = parent

    def lookup(self, name: str) -> str | None:
        s = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None


class OrderChecker(ast.NodeVisitor):
    """Collects (line, function, what) for each iteration over an unordered value."""

    def __init__(self):
        self.found: list[tuple[int, str, str]] = []
        self.scope = _Scope()
        self.attrs: dict[str, str] = {}  # self.<name> bound to an unordered value
        self.func: list[str] = []
        self._order_free: set[int] = set()  # ids of comprehensions consumed order-free

    # ---------------------------------------------------------------- what is unordered
    def unordered(self, node: ast.AST | None) -> str | None:
        """What kind of unordered value ``node`` is, or None when it is ordered."""
        if node is None:
            return None
        if isinstance(node, (ast.Set, ast.SetComp)):
            return "a set"
        if isinstance(node, ast.DictComp) and _is_id_call(node.key):
            return "a dict keyed by id()"
        if isinstance(node, ast.Dict) and any(_is_id_call(k) for k in node.keys if k):
            return "a dict keyed by id()"
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in _UNORDERED_CALLS:
                return "a set"
            if isinstance(f, ast.Attribute):
                if f.attr in _SET_METHODS:
                    return "a set"
                if f.attr in _LISTING_METHODS:
                    return f"a directory listing (.{f.attr}())"
                if isinstance(f.value, ast.Name) and (f.value.id, f.attr) in _LISTING_FUNCS:
                    return f"a directory listing ({f.value.id}.{f.attr}())"
                if f.attr in ("keys", "values", "items"):
                    inner = self.unordered(f.value)
                    return inner if inner == "a dict keyed by id()" else None
                if f.attr == "copy":
                    return self.unordered(f.value)
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd,
                                                                ast.Sub, ast.BitXor)):
            return self.unordered(node.left) or self.unordered(node.right)
        if isinstance(node, ast.Name):
            return self.scope.lookup(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return self.attrs.get(node.attr)
        return None

    @staticmethod
    def _annotated_set(ann: ast.AST | None) -> bool:
        if ann is None:
            return False
        base = ann.value if isinstance(ann, ast.Subscript) else ann
        return isinstance(base, ast.Name) and base.id in ("set", "frozenset", "Set",
                                                          "FrozenSet", "AbstractSet")

    def _bind(self, target: ast.AST, kind: str | None) -> None:
        if isinstance(target, ast.Name):
            if kind:
                self.scope.names[target.id] = kind
            else:
                self.scope.names.pop(target.id, None)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == "self" and kind:
            self.attrs[target.attr] = kind

    # ---------------------------------------------------------------- bindings
    def visit_Assign(self, node: ast.Assign) -> None:
        kind = self.unordered(node.value)
        for t in node.targets:
            self._bind(t, kind)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        kind = self.unordered(node.value) or ("a set" if self._annotated_set(node.annotation)
                                              else None)
        self._bind(node.target, kind)
        self.generic_visit(node)

    def _function(self, node) -> None:
        self.func.append(node.name)
        outer, self.scope = self.scope, _Scope(self.scope)
        for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
            if self._annotated_set(a.annotation):
                self.scope.names[a.arg] = "a set (by annotation)"
        self.generic_visit(node)
        self.scope = outer
        self.func.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    # ---------------------------------------------------------------- iterations
    def _flag(self, node: ast.AST, how: str, kind: str) -> None:
        self.found.append((node.lineno, ".".join(self.func) or "<module>",
                           f"{how} over {kind}"))

    def visit_For(self, node: ast.For) -> None:
        kind = self.unordered(node.iter)
        if kind:
            self._flag(node, "a for loop", kind)
        self.generic_visit(node)

    def _comprehension(self, node) -> None:
        if id(node) not in self._order_free and not isinstance(node, ast.SetComp):
            for gen in node.generators:
                kind = self.unordered(gen.iter)
                if kind:
                    self._flag(node, "a comprehension", kind)
        self.generic_visit(node)

    visit_ListComp = visit_GeneratorExp = visit_DictComp = visit_SetComp = _comprehension

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
            else None
        if name in _ORDER_FREE_CALLS and isinstance(f, ast.Name):
            for a in node.args:
                if isinstance(a, (ast.GeneratorExp, ast.ListComp)):
                    self._order_free.add(id(a))
        if isinstance(f, ast.Name) and name in _ITERATING_CALLS:
            for a in node.args:
                kind = self.unordered(a)
                if kind:
                    self._flag(node, f"{name}()", kind)
        if isinstance(f, ast.Attribute) and name in ("join", "fromkeys", "extend", "update") \
                and node.args:
            kind = self.unordered(node.args[0])
            if kind and not (name == "update" and kind == "a set"):
                self._flag(node, f".{name}()", kind)
        if isinstance(f, ast.Attribute) and name == "pop" and not node.args:
            kind = self.unordered(f.value)
            if kind == "a set":
                self._flag(node, ".pop()", kind)
        for a in node.args:
            if isinstance(a, ast.Starred):
                kind = self.unordered(a.value)
                if kind:
                    self._flag(node, "* unpacking", kind)
        self.generic_visit(node)


def check_source(text: str) -> list[tuple[int, str, str]]:
    """(line, function, what) for each order-dependent iteration in ``text``."""
    checker = OrderChecker()
    checker.visit(ast.parse(text))
    return sorted(checker.found)


def checked_files() -> list[Path]:
    out = []
    for name in CHECKED:
        p = ROOT / name
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []
    return out


def test_checker_finds_each_pattern():
    """The check can fail: each pattern it names is found in a small sample."""
    sample = '''
import os
from pathlib import Path

def f(buckets, comm, root: Path, params: set):
    for axis in {b.axis for b in buckets}:
        comm.all_reduce(axis)
    axes = set(b.axis for b in buckets)
    for a in axes:
        pass
    xs = [x for x in frozenset(buckets)]
    for p in root.iterdir():
        pass
    names = list(os.listdir(root))
    ids = {id(b): b for b in buckets}
    for k, v in ids.items():
        pass
    for p in params | {1}:
        pass
    comm.send(*axes)
    ", ".join(axes)
    axes.pop()

class C:
    def __init__(self, xs):
        self.seen = set(xs)

    def g(self):
        return [s for s in self.seen]
'''
    found = check_source(sample)
    lines = [line for line, _, _ in found]
    assert lines == [6, 9, 11, 12, 14, 16, 18, 20, 21, 22, 29], found


def test_checker_passes_ordered_and_order_free_uses():
    sample = '''
def f(buckets, root):
    for axis in dict.fromkeys(b.axis for b in buckets):
        pass
    for p in sorted(root.iterdir()):
        pass
    axes = {b.axis for b in buckets}
    if "dp" in axes and len(axes) > 1 and any(a == "tp" for a in axes):
        pass
    n = max(len(a) for a in axes)
    s = {a for a in axes if a}
    ids = {id(b) for b in buckets}
    return [b for b in buckets if id(b) in ids], sorted(axes)
'''
    assert check_source(sample) == []


def test_no_order_dependent_iteration_on_collective_paths():
    """No module that issues collectives iterates a set, a listing or an id()-keyed dict,
    except the allowed places (each with its reason)."""
    problems, used = [], set()
    for path in checked_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, func, what in check_source(path.read_text()):
            key = (rel, func.split(".")[-1])
            if key in ALLOWED:
                used.add(key)
                continue
            problems.append(f"threefold/{rel}:{line} in {func}: {what}")
    assert not problems, ("iteration whose order depends on the process (sort it, or keep "
                          "an ordered sequence):\n" + "\n".join(problems))
    assert used == set(ALLOWED), f"allow-list entries no longer needed: {set(ALLOWED) - used}"


# --------------------------------------------------------------------------------------------
# The same, run: each rank with its own hash seed, torch checking every collective
# --------------------------------------------------------------------------------------------
STEPS = 2
# a mixture's router losses are per micro-batch: each of the 4 ranks' 2 sequences is one, as
# in the single process the runs are compared with
MOE = {"model__num_local_experts": 4, "model__num_experts_per_tok": 2,
       "model__intermediate_size": 64, "train__micro_batch_size": 2}
LORA = {"lora__r": 4, "lora__alpha": 8, "data__seq_len": 128, "train__eval_batches": 1}
# one run per kind of layout, on 4 ranks: (name, model, overrides)
SEEDED_RUNS = [
    ("ep2_dp4", "moe", {"parallel__ep": 2}),
    ("ep2_dp4_zero3", "moe", {"parallel__ep": 2, "parallel__zero_stage": 3}),
    ("tp2_pp2", "dense", {"parallel__tp": 2, "parallel__pp": 2, "train__micro_batch_size": 2}),
    ("cp2_dp2", "dense", {"parallel__cp": 2}),
    ("lora_zero3", "lora", {"parallel__zero_stage": 3}),
]
MODELS = {"dense": {}, "moe": MOE, "lora": LORA}


def _task(model: str):
    from threefold.post import SFTTask

    return SFTTask() if model == "lora" else None


def _seeded_runs(rank, world, corpus, cache, root):
    """Each rank (its own hash seed): every run of SEEDED_RUNS in this process group."""
    import torch.distributed as dist

    from threefold.config import load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    for name, model, extra in SEEDED_RUNS:
        # a collective that waits a minute is a hang: fail then, not after ten
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               parallel__timeout_s=60, **MODELS[model],
                                               **extra))
        layout = Distributed(cfg)
        assert layout.ledger.enabled  # the suite checks every run's collectives
        train(cfg, layout, task=_task(model))
    return [a for a in {"dp", "edp"}]  # the order this rank's hash seed gives a set


@pytest.mark.slow
def test_layouts_train_under_different_hash_seeds_and_torch_debug(corpus, cache_dir, tmp_path,
                                                                  monkeypatch):
    """Ranks started with PYTHONHASHSEED 0, 1, 1, 0, so that every group of two ranks on
    these layouts (tp, cp, pp, edp: {0, 1}, {2, 3}, {0, 2}, {1, 3}) holds one rank of each seed
    and sees sets of strings in opposite orders (with 0, 1, 0, 1 the edp pairs {0, 2} and
    {1, 3} would agree, and DP's old replica check over {"dp", "edp"} would not deadlock), and
    torch's TORCH_DISTRIBUTED_DEBUG=DETAIL (which checks the op and shapes of every collective
    across the group) train ep × dp under ZeRO 0 and 3, tp × pp, cp × dp and LoRA under ZeRO-3 to
    one process's losses, with the collective check on at every step."""
    from tests.conftest import metrics
    from threefold.config import load_config
    from threefold.training.train import train

    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    got = run_distributed(_seeded_runs, 4, corpus, cache_dir, tmp_path, timeout=400,
                          hash_seeds=(0, 1, 1, 0))
    # neighbouring ranks really did see a set of axis names in opposite orders
    assert got[0] == got[3] == got[1][::-1] == got[2][::-1], got
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    refs = {}
    for model in MODELS:
        out = tmp_path / f"single_{model}"
        train(load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS,
                                               **MODELS[model])), task=_task(model))
        refs[model] = [r["loss"] for r in metrics(out)]
    for name, model, _ in SEEDED_RUNS:
        losses = [r["loss"] for r in metrics(tmp_path / name)]
        assert losses == pytest.approx(refs[model], rel=1e-5), name
