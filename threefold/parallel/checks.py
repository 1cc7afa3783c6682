"""The rules a layout must meet, checked before any process starts (the launcher), by the
dry run and by the trainer: one place, ``validate_layout``.

The mesh must fill the world (``ParallelDims.from_config``); the batch split over
data-parallel ranks and micro-batches (``check_batch``); context parallelism needs
data.seq_len divisible by 2·cp, sequence parallelism each cp rank's tokens by tp; with the
model's shape, heads and layers must split over tp and pp·vpp, and the pipeline split fit the
layers; the schedule must be complete and free of deadlock for its microbatches
(``check_schedule``, which reads the schedule registry). A mixture of experts
(``model.num_local_experts``) takes data parallelism, ZeRO, expert parallelism
(``parallel.ep`` dividing the experts; ep needs experts), tensor parallelism without sequence
parallelism and pipeline parallelism with the per-layer load-balancing loss; not context
parallelism yet.
"""

from __future__ import annotations

from threefold.config import Config, ConfigError, ModelConfig, param_dtype
from threefold.mesh import ParallelDims
from threefold.schedules.balance import split_counts
from threefold.schedules.check import check_schedule


def check_batch(cfg: Config, dp: int) -> None:
    """The global batch must split evenly over data-parallel ranks, and each rank's share
    into micro-batches (a micro-batch larger than a rank's share is that share)."""
    g, mb = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if g % dp:
        raise ConfigError(f"train.global_batch_size: {g} does not split over {dp} data-parallel "
                          f"ranks; use a multiple of {dp}")
    local = g // dp
    if local % min(mb, local):
        raise ConfigError(f"train.micro_batch_size: {mb} does not divide the {local} sequences "
                          f"each rank gets; use a divisor of {local}")


def pipeline_microbatches(cfg: Config, dp: int) -> int:
    """Pipeline microbatches per step: a rank's sequences / train.micro_batch_size (and
    ``parallel.microbatches``, when set, must agree)."""
    local = cfg.train.global_batch_size // dp
    m = local // min(cfg.train.micro_batch_size, local)
    if cfg.parallel.microbatches and cfg.parallel.microbatches != m:
        raise ConfigError(f"parallel.microbatches: {cfg.parallel.microbatches}, but "
                          f"train.micro_batch_size={cfg.train.micro_batch_size} makes {m} per "
                          f"step; set train.micro_batch_size to "
                          f"{max(1, local // cfg.parallel.microbatches)} or "
                          "parallel.microbatches 0")
    return m


def validate_layout(cfg: Config, world_size: int, mcfg: ModelConfig | None = None
                    ) -> ParallelDims:
    """Every rule a layout must meet (the module docstring lists them), in one place for the
    launcher (before any process starts), the dry run and the trainer; returns the
    ParallelDims. ``mcfg`` is the model's shape (the launcher has it unless the weights bring
    it): without it the rules on heads and layers wait for the trainer. Raises ConfigError
    naming the field and a value that works."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p, world_size)
    _check_experts(cfg, dims, mcfg)
    if param_dtype(cfg) == "bfloat16" and p.zero_stage == 0 and dims.dp * dims.cp > 1:
        raise ConfigError("parallel.param_dtype: bfloat16 parameters under data parallelism "
                          "need ZeRO (the 16-bit copies are what ZeRO gathers); set "
                          "parallel.zero_stage 1, 2 or 3, or parallel.param_dtype float32")
    check_batch(cfg, dims.dp)
    _check_sequence(cfg, dims)
    _check_pipeline(cfg, dims, mcfg)
    return dims


def _check_experts(cfg: Config, dims: ParallelDims, mcfg: ModelConfig | None) -> None:
    """A mixture of experts' rules: the per-layer balancing loss under pp, no cp or sequence
    parallelism, ep dividing the experts; and ep needs experts. Also what context
    parallelism's attention does not compute (a sliding window, another score scale)."""
    p = cfg.parallel
    m = mcfg if mcfg is not None else cfg.model
    experts = (mcfg.num_local_experts if mcfg is not None
               else cfg.model.resolved(vocab_size=1).num_local_experts)
    model_axes = [f"parallel.cp={dims.cp}"] if dims.cp > 1 else []
    if experts and dims.pp > 1 and m.router_aux_loss_coef > 0 \
            and not m.router_aux_loss_per_layer:
        raise ConfigError(f"model.router_aux_loss_per_layer: parallel.pp={dims.pp} with a "
                          "mixture of experts needs the load-balancing loss per layer (a stage "
                          "cannot pool f and P over the other stages' layers): set "
                          "model.router_aux_loss_per_layer true, or model.router_aux_loss_coef "
                          "0")
    if p.sequence_parallel and dims.tp > 1:
        model_axes.append("parallel.sequence_parallel=true")
    if experts and model_axes:
        raise ConfigError(f"model.num_local_experts: {experts} experts (a mixture of experts) "
                          f"train under data, expert and tensor parallelism and ZeRO, not with "
                          f"{', '.join(model_axes)} yet: set those to 1 (false), or "
                          "model.num_local_experts 0 for a dense model")
    for field in ("sliding_window", "query_pre_attn_scalar", "kv_lora_rank"):
        if dims.cp > 1 and getattr(m, field):
            raise ConfigError(f"model.{field}: {getattr(m, field)}: context parallelism "
                              f"(parallel.cp={dims.cp}) does not compute this attention yet; "
                              "set parallel.cp 1")
    if dims.ep > 1 and not experts:
        raise ConfigError(f"parallel.ep: {dims.ep} needs a mixture of experts "
                          "(model.num_local_experts > 0, e.g. --model.preset tiny-moe); set "
                          "parallel.ep 1 for a dense model")
    if experts and experts % dims.ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0 and dims.dp_shard % d == 0]
        raise ConfigError(f"parallel.ep: {dims.ep} does not divide model.num_local_experts="
                          f"{experts}; use an ep in {', '.join(map(str, valid))}")


def _check_sequence(cfg: Config, dims: ParallelDims) -> None:
    """Context parallelism needs data.seq_len divisible by 2·cp; sequence parallelism each cp
    rank's tokens by tp."""
    if dims.cp > 1 and cfg.data.seq_len % (2 * dims.cp):
        step = 2 * dims.cp
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} is not divisible by 2·parallel.cp ="
                          f" {step} (each cp rank holds two balanced chunks of every sequence);"
                          f" use a multiple of {step}, e.g. {-(-cfg.data.seq_len // step) * step}")
    local = cfg.data.seq_len // dims.cp
    if cfg.parallel.sequence_parallel and dims.tp > 1 and local % dims.tp:
        where = f"data.seq_len / parallel.cp = {local}" if dims.cp > 1 else \
            f"data.seq_len: {cfg.data.seq_len}"
        raise ConfigError(f"{where} is not divisible by parallel.tp={dims.tp}, which sequence "
                          f"parallelism needs; use a data.seq_len that is a multiple of "
                          f"{dims.tp * dims.cp * (2 if dims.cp > 1 else 1)}")


def _check_pipeline(cfg: Config, dims: ParallelDims, mcfg: ModelConfig | None) -> None:
    """vpp and block counts need pipeline stages; the model's heads and layers split over tp
    and pp·vpp (``validate_model``), the block counts fit its layers, and the schedule is
    complete and free of deadlock for its microbatches."""
    p = cfg.parallel
    if dims.pp == 1 and p.vpp > 1:
        raise ConfigError(f"parallel.vpp: {p.vpp} model chunks per stage need pipeline stages; "
                          "set parallel.pp > 1 or parallel.vpp 1")
    if dims.pp == 1 and p.pipeline_split not in ("params", "flops", "uniform"):
        raise ConfigError(f"parallel.pipeline_split: block counts '{p.pipeline_split}' need "
                          "pipeline stages; set parallel.pp > 1 or leave pipeline_split params")
    if mcfg is not None:
        dims.validate_model(mcfg, vpp=p.vpp)
    if dims.pp == 1:
        return
    if mcfg is not None:
        split_counts(p.pipeline_split, [0.0] * mcfg.num_hidden_layers, dims.pp * p.vpp)
    try:
        check_schedule(p.schedule, dims.pp, pipeline_microbatches(cfg, dims.dp), p.vpp,
                       p.pipeline_inflight)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"parallel.schedule: {e}") from None
