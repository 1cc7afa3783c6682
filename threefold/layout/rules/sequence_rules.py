"""The rule book: the sequence and context parallelism."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout.rules.book import LayoutError, rule


@rule
def seq_len_over_cp(seq_len: int, cp: int) -> None:
    """Each cp rank holds two balanced chunks of every sequence: seq_len divisible by 2·cp."""
    if cp > 1 and seq_len % (2 * cp):
        step = 2 * cp
        raise LayoutError(f"data.seq_len: {seq_len} is not divisible by 2·parallel.cp = {step} "
                          "(each cp rank holds two balanced chunks of every sequence); use a "
                          f"multiple of {step}, e.g. {-(-seq_len // step) * step}")


@rule
def sequence_parallel_tokens(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> None:
    """Sequence parallelism splits each cp rank's tokens over tp."""
    if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        where = f"data.seq_len / parallel.cp = {seq_len // cp}" if cp > 1 else \
            f"data.seq_len: {seq_len}"
        raise LayoutError(f"{where} is not divisible by parallel.tp={tp}, which sequence "
                          "parallelism needs; use a data.seq_len that is a multiple of "
                          f"{tp * cp * (2 if cp > 1 else 1)}")


@rule
def selective_without_cp(recompute: str, cp: int) -> None:
    """Selective recompute would keep every per-hop result of ring attention."""
    if recompute == "selective" and cp > 1:
        raise LayoutError("train.recompute: selective is not available with parallel.cp > 1 "
                          "(ring attention's per-hop results would all be kept); use full or "
                          "none")


@rule
def mlp_tiles_plain(tiles: int, recompute: str, tp_overlap: int, experts: int) -> None:
    """The tiled MLP takes its input tile by tile through plain projections of a dense MLP."""
    clash = ("train.recompute selective" if recompute == "selective" else
             "parallel.tp_overlap" if tp_overlap > 1 else
             "a mixture of experts" if experts else "")
    if tiles > 1 and clash:
        raise LayoutError(f"train.mlp_tiles: {tiles} tiles a dense MLP with plain projections, "
                          f"not with {clash}; set train.mlp_tiles 1")


@rule
def cp_attention_sinks(m: ModelConfig, cp: int) -> None:
    """Context parallelism's ring and all-gather attention have no term for a sink's logit
    (GPT-OSS): its softmax denominators would leave the sinks out."""
    if cp > 1 and m.attention_sinks:
        raise LayoutError(f"model.attention_sinks: true: context parallelism "
                          f"(parallel.cp={cp}) does not add the sinks to its softmax yet; set "
                          "parallel.cp 1")


@rule
def cp_attention(m: ModelConfig, cp: int) -> None:
    """Context parallelism's attention computes neither a sliding window, another score scale
    nor latent attention."""
    for field in ("sliding_window", "query_pre_attn_scalar", "kv_lora_rank"):
        if cp > 1 and getattr(m, field):
            raise LayoutError(f"model.{field}: {getattr(m, field)}: context parallelism "
                              f"(parallel.cp={cp}) does not compute this attention yet; set "
                              "parallel.cp 1")


@rule
def mtp_without_cp(depth: int, cp: int) -> None:
    """Multi-token prediction embeds the tokens k ahead of each position: a cp rank's slice
    of the sequence does not hold them."""
    if depth and cp > 1:
        raise LayoutError(f"parallel.cp: {cp} with multi-token prediction "
                          f"(model.num_nextn_predict_layers={depth}) is not built yet (a rank's "
                          "slice lacks the tokens ahead); set parallel.cp 1")
