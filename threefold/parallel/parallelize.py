"""The one place that says in which order threefold parallelises a model, and where its
values come from.

``parallelize`` builds the plain model on the meta device (shapes, no storage), adapts it
(a task's head; LoRA's adapters with the rest frozen, ``threefold.model.lora``) and applies, in
this order:

1. the pipeline split: this rank keeps its stages' modules (the rest is never built);
2. tensor parallelism (and sequence parallelism), which slices weights by placement;
3. context parallelism (attention only; no weights change);
4. expert parallelism: this rank's run of experts;
   then, under ``train.fp8``, the blocks' projections become FP8 layers
   (``threefold.parallel.transforms.fp8_linear``), each keeping its tensor-parallel split;
5. activation recomputation, full or selective (``threefold.parallel.transforms.recompute``:
   each block becomes its recomputing subclass);
6. torch.compile of each block, and of the head with its loss;
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

from threefold.config import Config, ModelConfig, fp8_all_gather, param_dtype
from threefold.model.lora import apply_lora
from threefold.model.decoder import CausalLM
from threefold.parallel.transforms.context import apply_context_parallel
from threefold.parallel.engines.data_parallel import DataParallelEngine
from threefold.parallel.engines.engine import LocalEngine
from threefold.parallel.transforms.expert import apply_expert_parallel
from threefold.parallel.transforms.expert_dispatch import apply_hierarchical_dispatch
from threefold.parallel.transforms.fp8_experts import apply_fp8_experts
from threefold.parallel.transforms.fp8_linear import apply_fp8
from threefold.parallel.transforms.mlp_tiles import apply_mlp_tiles
from threefold.parallel.transforms.recompute import apply_recompute
from threefold.parallel.materialize import materialize_buffers, materialize_parameters
from threefold.parallel.transforms.tensor import apply_tensor_parallel
from threefold.parallel.engines.zero import ZeroEngine

ORDER = ("pipeline split", "tensor + sequence parallel", "context parallel", "expert parallel",
         "FP8 projections (train.fp8)", "activation recompute", "compile",
         "engine (ZeRO / data parallel / offload): allocate and fill this rank's tensors")


def apply_compile(model: CausalLM) -> None:
    """torch.compile each block in place (names unchanged; each is one graph), and the head
    with its chunked loss where its vocabulary is whole (a vocab-parallel loss's all-reduces
    would break its graph)."""
    for block in model.model.layers:
        block.compile()
    if model.lm_head is not None and model.lm_head.shard is None:
        model.lm_head.compile()


def dtypes(cfg: Config) -> tuple[torch.dtype | None, torch.dtype]:
    """(parameter compute dtype, gradient reduction dtype) of ``cfg`` for the engines; the
    first None where it is the parameters' own float32."""
    pd = torch.bfloat16 if param_dtype(cfg) == "bfloat16" else None
    return pd, getattr(torch, cfg.parallel.reduce_dtype)


def apply_model_parallel(model: CausalLM, cfg: Config, layout) -> CausalLM:
    """Steps 2-4: tensor parallelism (and sequence parallelism) over "tp", context
    parallelism over "cp", expert parallelism over "ep", each when its degree is above 1."""
    if layout.tp_size > 1:
        model = apply_tensor_parallel(model, layout.comm, cfg.parallel.sequence_parallel,
                                      cfg.parallel.tp_overlap)
    if layout.cp_size > 1:
        model = apply_context_parallel(model, layout.comm, cfg.parallel.cp_algorithm,
                                       layout.dims.ulysses, cfg.parallel.cp_balance)
    if layout.ep_size > 1:
        model = apply_expert_parallel(model, layout.comm)
        if cfg.parallel.ep_dispatch == "hierarchical":
            model = apply_hierarchical_dispatch(model, layout.comm)
    return model


def zero_units(model: CausalLM, ep: int) -> tuple[list[nn.Module], dict[int, str]]:
    """ZeRO's units in forward order (the embedding, each block, the final norm, the head:
    what a pipeline stage holds of them) and the axis of those that do not shard over
    dp_shard: under expert parallelism each block's experts are a unit of their own over
    "edp_shard"."""
    m = model.model
    units, axes = [], {}
    for u in (m.embed_tokens, *m.layers, m.mtp_embed, m.norm, model.lm_head):
        if u is None:
            continue
        units.append(u)
        experts = getattr(getattr(u, "mlp", None), "experts", None)  # a block's MoE, if any
        if ep > 1 and experts is not None:
            units.append(experts)
            axes[len(units) - 1] = "edp_shard"
    return units, axes


def build_engine(model: nn.Module, cfg: Config, layout, source=None,
                 device: torch.device | None = None, frozen: bool = False) -> Any:
    """Step 7, the engine for ``layout``: plain AdamW for one process, data parallel for ZeRO
    stage 0, the ZeRO engine for stages 1-3 (over dp × cp); the optimiser in host memory
    with ``parallel.offload_optimizer``. With a ``source`` the model's parameters are still
    on the meta device and the engine gives them storage on ``device``, filled from it: ZeRO
    only this rank's shards, the others every local tensor, one at a time.

    ``frozen`` (a reference model that never steps): ZeRO-3 keeps its shards and gathers
    around use as for training; every other layout holds the plain local tensors, in the
    compute dtype, with no gradient buckets, masters or host copies."""
    p = cfg.parallel
    off, device = p.offload_optimizer and not frozen, device or layout.device
    param_dtype, reduce_dtype = dtypes(cfg)
    if frozen and (layout.comm is None or p.zero_stage != 3):
        materialize_parameters(model, source, device)
        for q in model.parameters():
            q.requires_grad_(False)
            if param_dtype is not None:
                q.data = q.data.to(param_dtype)
        return LocalEngine(model, cfg.optim, layout.comm)
    if layout.comm is None or p.zero_stage == 0:
        if source is not None:
            materialize_parameters(model, source, device)
        if layout.comm is None or layout.dp_size * layout.cp_size == 1:
            return LocalEngine(model, cfg.optim, layout.comm, offload=off,
                               param_dtype=param_dtype)
        return DataParallelEngine(model, cfg.optim, layout.comm, p.bucket_mb,
                                  axis=layout.data_axis, offload=off,
                                  expert_axis="edp" if layout.ep_size > 1 else None)
    units, axes = zero_units(model, layout.ep_size)
    return ZeroEngine(model, units, cfg.optim, layout.comm, p.zero_stage,
                      shard_axis=layout.shard_axis, offload=off, unit_axes=axes,
                      source=source, device=device, param_dtype=param_dtype,
                      reduce_dtype=reduce_dtype, fp8_gather=fp8_all_gather(cfg) and not frozen)


def parallelize(mcfg: ModelConfig, cfg: Config, layout, source, device: torch.device,
                adapt: Callable[[nn.Module], nn.Module] | None = None,
                frozen: bool = False, trainable: tuple[str, ...] = ()) -> Any:
    """The engine of this rank's part of the model ``mcfg``, parallelised by ``layout`` in
    the order of the module doc, its tensors filled from ``source`` (``InitSource`` for a
    fresh run, a checkpoint or Hugging Face folder for a pretrained one). ``adapt`` changes
    the plain (meta) model first, e.g. a reward model's score head in place of the LM head.
    ``frozen``: a model that never trains (a reference): no checkpointing, no compile, no
    optimiser's buffers (see ``build_engine``)."""
    with torch.device("meta"):
        model = CausalLM(mcfg)
    if adapt is not None:
        model = adapt(model)
    if not frozen:  # LoRA: adapters on the named layers, the rest (but ``trainable``) frozen
        model = apply_lora(model, cfg.lora, trainable)
    model = layout.split_pipeline(model)           # 1
    model = apply_mlp_tiles(model, cfg.train.mlp_tiles)  # inside tp's operators (module doc)
    model = apply_model_parallel(model, cfg, layout)  # 2, 3, 4
    if not frozen:  # FP8 over the (sliced) projections, before recompute wraps the blocks
        apply_fp8(model, cfg.train.fp8, layout.comm if layout.tp_size > 1 else None)
        apply_fp8_experts(model, cfg.train.fp8)  # the routed experts (after ep), same recipe
        apply_recompute(model, cfg.train.recompute_mode,  # 5
                        cfg.train.recompute_module_names)
    if cfg.train.compile and not frozen:                   # 6
        apply_compile(model)
    materialize_buffers(model, device, source)
    return build_engine(model, cfg, layout, source, device, frozen)  # 7
