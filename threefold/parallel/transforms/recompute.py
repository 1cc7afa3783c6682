"""Activation recomputation of the transformer blocks (``train.recompute``), in place: each
block becomes its ``Checkpointed``/``Selective`` subclass (``print(model)`` shows it), so
parameter names, checkpoints and the modules pipeline chunks share do not change.

- **full**: the block runs under ``torch.utils.checkpoint`` (non-reentrant) and keeps only its
  input; backward re-runs its whole forward (Chen et al., arXiv 1604.06174).
- **selective**: the same checkpoint with a selective policy (torch's own under
  ``torch.compile``; in eager a pair of dispatch modes, ``_Keep`` and ``_Reuse``, which let a
  zero-bubble W recompute a block again after its B): the outputs of the matmuls (``aten.mm``,
  ``aten.addmm``: every projection) and of the fused attention kernels are kept, and
  everything between them — RMSNorm, RoPE, SwiGLU's product, the residual additions, autocast's
  casts of activations and weights — is recomputed from them in backward. The recomputation
  is memory-bound work only, no matmul; a materialised (math-path) attention, made of ``bmm``
  and softmax, is recomputed whole, which is Korthikanti et al.'s selective recompute of the
  attention core (arXiv 2205.05198 §5). What a block then keeps per token is
  ``threefold.plan.selective.selective_layer_bytes``, which the planner and dry run use.

A mixture-of-experts block keeps, beyond its matmuls' outputs (the router's logits, every
expert's, grouped or looped: ``aten._grouped_mm`` or ``aten.mm``, and under FP8
``aten._scaled_grouped_mm`` or ``aten._scaled_mm``), the router's choice (the
outputs of ``aten.topk``), so the recompute routes exactly as the forward did (the sort by
expert and the counts are recomputed from it, identically), and the results of expert
parallelism's count exchange, dispatch and combine (``replayed``): the recompute runs no
all-to-all. Tensor parallelism's collectives are not kept: the recomputed forward runs them
again, as under full recompute (which runs a block's all-to-alls again too), and the
accounting counts them so. Context parallelism is refused for selective (the rule book names
it).

**Modules** (``train.recompute_modules``, Megatron's ``--recompute-modules`` names): a selective
policy may name more of the block to recompute. A named module keeps none of its matmul
outputs, so it runs again whole in backward, from the kept outputs before it: ``core_attn``
(the fused attention kernel's output and log-sum-exp), ``mla_up_proj`` (latent attention's
``q_b_proj`` and ``kv_b_proj``), ``mlp`` (a dense block's MLP), ``moe`` (the router's logits
and every expert, shared ones included) and ``shared_experts``. ``layernorm`` and ``moe_act``
(the norms and SwiGLU's product) are what every selective block recomputes already: naming
them changes nothing, and the default (no names) equals ``layernorm,moe_act``. What is
always kept, named or not: the router's choice (so a recomputed ``moe`` routes as the
forward did) and the ``replayed`` all-to-alls' results (no policy sends a row twice). The
modules are found by forward hooks on the block's sub-modules, in eager mode only (the rule
book refuses them under ``train.compile``).
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

# ops whose outputs selective recompute keeps; names a torch build lacks are skipped
_ATTENTION_NAMES = ("_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention")
_KEPT_NAMES = ("mm", "addmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
               "topk") + _ATTENTION_NAMES
# kept inside a recomputed module too: the router's choice
_ALWAYS_NAMES = ("topk",)


def _aten(names) -> frozenset:
    ops = []
    for name in names:
        try:
            ops.append(getattr(torch.ops.aten, name).default)
        except AttributeError:  # an op this torch build does not have
            continue
    return frozenset(ops)


@functools.cache
def kept_ops(modules: tuple = ()) -> frozenset:
    """The aten overloads whose outputs a selective block keeps (outside the recomputed
    modules): the attention kernels' not when ``modules`` names core_attn."""
    drop = _ATTENTION_NAMES if "core_attn" in modules else ()
    return _aten(n for n in _KEPT_NAMES if n not in drop)


def _policy(modules: tuple, _ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in kept_ops(modules) \
        else CheckpointPolicy.PREFER_RECOMPUTE


# the selective block calls under way (their _Keep or _Reuse), innermost last
_TAPES: list = []


def replayed(fn, *args):
    """``fn(*args)``, run once per selective block call: in a selective block's forward its
    output is kept (with the matmuls', in call order) and the block's recompute gets it back
    without running ``fn`` (expert parallelism's all-to-alls, which then move nothing twice).
    Outside a selective block (no recompute, full recompute, torch.compile's policy) it
    simply runs."""
    return _TAPES[-1].replay(fn, args) if _TAPES else fn(*args)


def _key(fn):
    return getattr(fn, "__func__", fn)  # a bound method is a new object at every access


class _Tape(TorchDispatchMode):
    """A dispatch mode that is also the innermost selective block call while entered;
    ``depth`` counts the recomputed modules (``recompute_modules``) it is inside."""

    def __init__(self, kept: list, modules: tuple):
        super().__init__()
        self.kept, self.ops, self.depth = kept, kept_ops(modules), 0
        self.always = _aten(_ALWAYS_NAMES)

    def keeps(self, func) -> bool:
        """Whether ``func``'s output is kept here (the same answer in forward and recompute:
        both run the same modules in the same order)."""
        return func in self.ops and (not self.depth or func in self.always)

    def __enter__(self):
        self.depth = 0  # (a recompute stopped early may have left a module open)
        _TAPES.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _TAPES.remove(self)
        return super().__exit__(*exc)


class _Keep(_Tape):
    """The forward half: runs every op and keeps the outputs of ``kept_ops`` (and of
    ``replayed`` calls) in call order."""

    def __init__(self, kept: list, modules: tuple = ()):
        super().__init__(kept, modules)
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and self.keeps(func):
            self.kept.append((func, out, _versions(out)))
        return out

    def replay(self, fn, args):
        """Run ``fn`` and keep its output; what it runs inside is not kept on its own."""
        self.paused += 1
        try:
            out = fn(*args)
        finally:
            self.paused -= 1
        self.kept.append((_key(fn), out, _versions(out)))
        return out


class _Reuse(_Tape):
    """The recompute half: the kept ops give back what the forward kept (in the same order),
    every other op runs again. Unlike torch's own selective checkpoint, the kept outputs
    stay for a second recompute: a zero-bubble W re-enters a block after its B did."""

    def __init__(self, kept: list, modules: tuple = ()):
        super().__init__(kept, modules)
        self.next = 0

    def __enter__(self):
        self.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.keeps(func):
            return func(*args, **(kwargs or {}))
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach,
                                                 self._take(func))

    def replay(self, fn, args):
        """What ``fn`` gave the forward, without running it. Above autograd, unlike the ops
        below: a fresh leaf that requires grad where the kept output did, so the recomputed
        ops after it save for backward what the forward's did."""
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad),
            self._take(_key(fn)))

    def _take(self, func):
        op, out, versions = self.kept[self.next]
        self.next += 1
        if op is not func or _versions(out) != versions:
            raise RuntimeError(f"selective recompute: {func} does not replay the forward's "
                               f"{op} (or its output was changed in place since)")
        return out


def _versions(out) -> list:
    return [t._version for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor)]


def _selective_contexts(modules: tuple = ()):
    """The (forward, recompute) contexts of one selective block call: under torch.compile
    torch's own policy (which dynamo understands), else ``_Keep``/``_Reuse``."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(functools.partial(_policy, modules))
    kept: list = []
    return _Keep(kept, modules), _Reuse(kept, modules)


def _enter_module(_module, _args) -> None:
    if _TAPES:
        _TAPES[-1].depth += 1


def _leave_module(_module, _args, _out) -> None:
    if _TAPES:
        _TAPES[-1].depth -= 1


def recomputed_submodules(block, modules: tuple) -> list:
    """The sub-modules of ``block`` that ``modules`` names (``core_attn`` is an op, not a
    module: ``kept_ops``; ``layernorm`` and ``moe_act`` keep no matmul output anyway)."""
    attn, mlp = block.self_attn, block.mlp
    routed = hasattr(mlp, "experts")
    out = []
    if "mla_up_proj" in modules:
        out += [getattr(attn, n, None) for n in ("q_b_proj", "kv_b_proj")]
    if "mlp" in modules and not routed or "moe" in modules and routed:
        out.append(mlp)
    elif "shared_experts" in modules and routed:
        out += [mlp.shared_expert, mlp.shared_expert_gate, mlp.shared_experts]
    return [m for m in out if m is not None]


_SUBCLASSES: dict[tuple[type, str, tuple], type] = {}


def recomputed(cls: type, mode: str, modules: tuple = ()) -> type:
    """``cls`` (a transformer block class) whose forward runs under a non-reentrant checkpoint:
    ``mode`` "full" (``Checkpointed<Block>``) or "selective" (``Selective<Block>``, with
    ``modules`` recomputed too)."""
    if (cls, mode, modules) not in _SUBCLASSES:
        extra = {"context_fn": functools.partial(_selective_contexts, modules)} \
            if mode == "selective" else {}

        def forward(self, *args, **kwargs):
            return checkpoint(super(sub, self).forward, *args, use_reentrant=False,
                              **extra, **kwargs)

        prefix = "Selective" if mode == "selective" else "Checkpointed"
        what = "its matmul outputs kept, the rest recomputed" if mode == "selective" \
            else "recomputed in backward"
        if modules:
            what += f" ({', '.join(modules)} recomputed whole)"
        sub = type(f"{prefix}{cls.__name__}", (cls,),
                   {"forward": forward, "__doc__": f"{cls.__name__}, {what}."})
        _SUBCLASSES[(cls, mode, modules)] = sub
    return _SUBCLASSES[(cls, mode, modules)]


def apply_recompute(model, mode: str = "full", modules: tuple = ()) -> None:
    """Make every block of ``model`` recompute its activations in backward (``mode`` "full"
    or "selective", with ``modules`` (``train.recompute_modules``) recomputed too; "none"
    leaves them)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute '{mode}' is not none, selective or full")
    modules = tuple(sorted(set(modules))) if mode == "selective" else ()
    done = set(_SUBCLASSES.values())
    for block in model.model.layers:
        if type(block) in done:
            continue
        block.__class__ = recomputed(type(block), mode, modules)
        for sub in recomputed_submodules(block, modules):
            sub.register_forward_pre_hook(_enter_module)
            sub.register_forward_hook(_leave_module, always_call=True)
