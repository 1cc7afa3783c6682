"""The rule book: the batch and the numerics."""

from __future__ import annotations

from threefold.layout.rules.book import LayoutError, rule


@rule
def batch_over_dp(global_batch: int, dp: int) -> None:
    """The global batch splits evenly over the data-parallel ranks."""
    if global_batch % dp or not global_batch:
        raise LayoutError(f"train.global_batch_size: {global_batch} does not split over {dp} "
                          f"data-parallel ranks; use a multiple of {dp}")


@rule
def micro_batch_divides(global_batch: int, dp: int, micro: int) -> None:
    """Each rank's share of the batch splits into micro-batches (a micro-batch larger than
    the share is the share)."""
    local = global_batch // dp
    if local % min(micro, local):
        raise LayoutError(f"train.micro_batch_size: {micro} does not divide the {local} "
                          f"sequences each rank gets; use a divisor of {local}")


@rule
def microbatches_agree(asked: int, micro: int, local: int) -> None:
    """``parallel.microbatches``, when set, is what the batch makes: local / micro."""
    made = local // min(micro, local)
    if asked and asked != made:
        raise LayoutError(f"parallel.microbatches: {asked}, but train.micro_batch_size={micro} "
                          f"makes {made} per step; set train.micro_batch_size to "
                          f"{max(1, local // asked)} or parallel.microbatches 0")


@rule
def bf16_params_need_zero(dtype: str, zero_stage: int, data_ranks: int) -> None:
    """16-bit parameters under data parallelism are what ZeRO gathers: they need ZeRO."""
    if dtype == "bfloat16" and zero_stage == 0 and data_ranks > 1:
        raise LayoutError("parallel.param_dtype: bfloat16 parameters under data parallelism "
                          "need ZeRO (the 16-bit copies are what ZeRO gathers); set "
                          "parallel.zero_stage 1, 2 or 3, or parallel.param_dtype float32")
