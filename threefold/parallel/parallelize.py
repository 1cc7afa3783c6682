"""The one place that says in which order threefold parallelises a model, and where its
values come from.

``parallelize`` builds the plain model on the meta device (shapes, no storage) and applies,
in this order:

1. the pipeline split: this rank keeps its stages' modules (the rest is never built);
2. tensor parallelism (and sequence parallelism), which slices weights by placement;
3. context parallelism (attention only; no weights change);
4. expert parallelism: this rank's run of experts;
5. activation checkpointing (wrapper modules around the blocks);
6. torch.compile of each block;
7. the engine — ZeRO, data parallel or one process, the optimiser on the device or the host —
   which allocates what the rank keeps and fills it from the source, one logical tensor at a
   time (``threefold.parallel.materialize``): its ZeRO shards only, or its whole local
   tensors.

Why this order: each step sees the model as the previous one left it; slicing (2-4) must
happen before anything is allocated, so that no rank ever holds the whole model; activation
checkpointing and compile wrap the blocks as they will run (sliced, with their collectives);
the engine comes last because it flattens and shards the parameters that exist by then.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from threefold.config import Config, ModelConfig
from threefold.model import LlamaForCausalLM
from threefold.parallel.materialize import materialize_buffers

ORDER = ("pipeline split", "tensor + sequence parallel", "context parallel", "expert parallel",
         "activation checkpointing", "compile", "engine (ZeRO / data parallel / offload): "
         "allocate and fill this rank's tensors")


def apply_activation_checkpointing(model: LlamaForCausalLM) -> None:
    """Recompute each transformer block in backward. The block's forward is wrapped in place,
    so parameter names (and checkpoints) do not change."""
    from torch.utils.checkpoint import checkpoint

    for block in model.model.layers:
        inner = block.forward
        block.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def apply_compile(model: LlamaForCausalLM) -> None:
    """torch.compile each block in place (names unchanged)."""
    for block in model.model.layers:
        block.compile()


def parallelize(mcfg: ModelConfig, cfg: Config, layout, source, device: torch.device,
                adapt: Callable[[nn.Module], nn.Module] | None = None) -> Any:
    """The engine of this rank's part of the model ``mcfg``, parallelised by ``layout`` in
    the order of the module doc, its tensors filled from ``source`` (``InitSource`` for a
    fresh run, a checkpoint or Hugging Face folder for a pretrained one). ``adapt`` changes
    the plain (meta) model first, e.g. a reward model's score head in place of the LM head."""
    from threefold.parallel.layout import build_engine

    with torch.device("meta"):
        model = LlamaForCausalLM(mcfg)
    if adapt is not None:
        model = adapt(model)
    model = layout.split_pipeline(model)           # 1
    model = layout.parallelize(model, cfg)         # 2, 3, 4
    if cfg.train.activation_checkpointing:         # 5
        apply_activation_checkpointing(model)
    if cfg.train.compile:                          # 6
        apply_compile(model)
    materialize_buffers(model, device)
    return build_engine(model, cfg, layout, source, device)  # 7
