"""The rule book: the pipeline."""

from __future__ import annotations

from threefold.layout.rules.book import LayoutError, rule
from threefold.schedules.registry import SCHEDULE_SPECS


@rule
def vpp_needs_pp(pp: int, vpp: int) -> None:
    """Model chunks per stage need pipeline stages."""
    if pp == 1 and vpp > 1:
        raise LayoutError(f"parallel.vpp: {vpp} model chunks per stage need pipeline stages; "
                          "set parallel.pp > 1 or parallel.vpp 1")


@rule
def block_counts_need_pp(pp: int, split: str) -> None:
    """Block counts per stage (parallel.pipeline_split 7,9,9,7) need pipeline stages."""
    if pp == 1 and split not in ("params", "flops", "uniform") and not split.startswith("flops:"):
        raise LayoutError(f"parallel.pipeline_split: block counts '{split}' need pipeline "
                          "stages; set parallel.pp > 1 or leave pipeline_split params")


@rule
def schedule_chunks(schedule: str, pp: int, vpp: int) -> None:
    """A V schedule runs two chunks per rank, interleaved 1F1B any number, the others one."""
    spec = SCHEDULE_SPECS[schedule]
    if pp > 1 and spec.vshape and vpp != 2:
        raise LayoutError(f"parallel.schedule: {schedule} runs two model chunks per rank in a V: "
                          f"set parallel.vpp 2 (got vpp={vpp})")
    if pp > 1 and vpp > 1 and not (spec.chunked or spec.vshape):
        raise LayoutError(f"parallel.schedule: {schedule} runs one model chunk per rank: set "
                          f"parallel.vpp 1, or parallel.schedule interleaved-1f1b for vpp={vpp}")


@rule
def interleaved_microbatches(schedule: str, pp: int, microbatches: int) -> None:
    """Interleaved 1F1B takes its microbatches in rounds of pp."""
    if pp > 1 and SCHEDULE_SPECS[schedule].chunked and microbatches % pp:
        raise LayoutError(f"parallel.schedule: {schedule} needs microbatches a multiple of "
                          f"parallel.pp={pp} (got {microbatches}: global batch / (dp · micro "
                          "batch)); change train.global_batch_size or train.micro_batch_size, "
                          "or use schedule 1f1b")


@rule
def pipeline_inflight(schedule: str, pp: int, vpp: int, inflight: int) -> None:
    """The bound on chunk activations in flight is interleaved 1F1B's, and lets the first
    backward start."""
    if pp == 1 or not inflight:
        return
    if not SCHEDULE_SPECS[schedule].chunked:
        raise LayoutError(f"parallel.pipeline_inflight: {inflight} bounds interleaved-1f1b "
                          f"only, not {schedule}; set it to 0")
    low = (vpp - 1) * pp + 1
    if inflight < low:
        raise LayoutError(f"parallel.pipeline_inflight: {inflight} is below (vpp-1)·pp + 1 = "
                          f"{low}: the first backward could never start; raise it, or 0 for "
                          "Megatron's warm-up")


@rule
def mtp_tied_pipeline(depth: int, tied: bool, pp: int) -> None:
    """The last stage's multi-token-prediction modules embed with a copy of the embedding;
    with a tied head there would be two copies of one weight there."""
    if depth and tied and pp > 1:
        raise LayoutError(f"model.tie_word_embeddings: a tied head with multi-token prediction "
                          f"(model.num_nextn_predict_layers={depth}) is not built under "
                          f"pipeline parallelism (pp={pp}); untie it or set parallel.pp 1")
