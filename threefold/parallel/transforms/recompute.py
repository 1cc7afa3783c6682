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
  ``threefold.plan.activations.selective_block_bytes``, which the planner and dry run use.

Collectives inside a block (tensor parallelism's, expert parallelism's) are not kept: the
recomputed forward runs them again, as under full recompute, and the accounting counts them
so. Context parallelism and mixtures of experts are refused for selective (config
validation names them).
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

# ops whose outputs selective recompute keeps; names a torch build lacks are skipped
_KEPT_NAMES = ("mm", "addmm", "_scaled_mm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention")


@functools.cache
def kept_ops() -> frozenset:
    """The aten overloads whose outputs a selective block keeps."""
    ops = []
    for name in _KEPT_NAMES:
        try:
            ops.append(getattr(torch.ops.aten, name).default)
        except AttributeError:  # an op this torch build does not have
            continue
    return frozenset(ops)


def _policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


class _Keep(TorchDispatchMode):
    """The forward half: runs every op and keeps the outputs of ``kept_ops`` in call order."""

    def __init__(self, kept: list):
        super().__init__()
        self.kept, self.ops = kept, kept_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.kept.append((func, out, _versions(out)))
        return out


class _Reuse(TorchDispatchMode):
    """The recompute half: the kept ops give back what the forward kept (in the same order),
    every other op runs again. Unlike torch's own selective checkpoint, the kept outputs
    stay for a second recompute: a zero-bubble W re-enters a block after its B did."""

    def __init__(self, kept: list):
        super().__init__()
        self.kept, self.next, self.ops = kept, 0, kept_ops()

    def __enter__(self):
        self.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.ops:
            return func(*args, **(kwargs or {}))
        op, out, versions = self.kept[self.next]
        self.next += 1
        if op is not func or _versions(out) != versions:
            raise RuntimeError(f"selective recompute: {func} does not replay the forward's "
                               f"{op} (or its output was changed in place since)")
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)


def _versions(out) -> list:
    return [t._version for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor)]


def _selective_contexts():
    """The (forward, recompute) contexts of one selective block call: under torch.compile
    torch's own policy (which dynamo understands), else ``_Keep``/``_Reuse``."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_policy)
    kept: list = []
    return _Keep(kept), _Reuse(kept)


_SUBCLASSES: dict[tuple[type, str], type] = {}


def recomputed(cls: type, mode: str) -> type:
    """``cls`` (a transformer block class) whose forward runs under a non-reentrant checkpoint:
    ``mode`` "full" (``Checkpointed<Block>``) or "selective" (``Selective<Block>``)."""
    if (cls, mode) not in _SUBCLASSES:
        extra = {"context_fn": _selective_contexts} if mode == "selective" else {}

        def forward(self, *args, **kwargs):
            return checkpoint(super(sub, self).forward, *args, use_reentrant=False,
                              **extra, **kwargs)

        prefix = "Selective" if mode == "selective" else "Checkpointed"
        what = "its matmul outputs kept, the rest recomputed" if mode == "selective" \
            else "recomputed in backward"
        sub = type(f"{prefix}{cls.__name__}", (cls,),
                   {"forward": forward, "__doc__": f"{cls.__name__}, {what}."})
        _SUBCLASSES[(cls, mode)] = sub
    return _SUBCLASSES[(cls, mode)]


def apply_recompute(model, mode: str = "full") -> None:
    """Make every block of ``model`` recompute its activations in backward (``mode`` "full"
    or "selective"; "none" leaves them)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute '{mode}' is not none, selective or full")
    done = set(_SUBCLASSES.values())
    for block in model.model.layers:
        if type(block) not in done:
            block.__class__ = recomputed(type(block), mode)
