"""The rule book: the sequence and context parallelism."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.layout.rules.book import LayoutError, rule


@rule
def seq_len_over_cp(seq_len: int, cp: int, algorithm: str = "ring") -> None:
    """Each cp rank holds two balanced chunks of every sequence (a ring's or all-gather's, a
    hybrid's too): seq_len divisible by 2·cp; Ulysses cuts it in cp equal slices."""
    step = cp if algorithm == "ulysses" else 2 * cp
    if cp > 1 and seq_len % step:
        why = "each cp rank holds an equal slice of every sequence" if algorithm == "ulysses" \
            else "each cp rank holds two balanced chunks of every sequence"
        name = "parallel.cp" if algorithm == "ulysses" else "2·parallel.cp"
        raise LayoutError(f"data.seq_len: {seq_len} is not divisible by {name} = {step} "
                          f"({why}); use a multiple of {step}, e.g. "
                          f"{-(-seq_len // step) * step}")


@rule
def ulysses_degree(cp: int, algorithm: str, cp_ulysses: int) -> None:
    """A hybrid's Ulysses degree divides cp (cp = ring ranks × Ulysses ranks); under
    cp_algorithm ulysses every cp rank is a Ulysses rank."""
    if cp_ulysses == 1 or (cp_ulysses == cp and algorithm != "ulysses"):
        return
    if algorithm == "ulysses":
        raise LayoutError(f"parallel.cp_ulysses: {cp_ulysses} with parallel.cp_algorithm "
                          f"ulysses (all {cp} cp ranks run the all-to-all); set "
                          "parallel.cp_ulysses 1, or cp_algorithm ring or allgather for a "
                          "hybrid")
    if cp % cp_ulysses:
        valid = [d for d in range(2, cp + 1) if cp % d == 0]
        raise LayoutError(f"parallel.cp_ulysses: {cp_ulysses} does not divide parallel.cp={cp} "
                          f"(cp = ring ranks × Ulysses ranks); use one of "
                          f"{', '.join(map(str, [1, *valid]))}")


@rule
def heads_over_ulysses(m: ModelConfig, tp: int, ulysses: int) -> None:
    """Ulysses gives each of its ranks whole heads: query heads divisible by tp·ulysses."""
    heads = m.num_attention_heads
    if ulysses > 1 and heads % (tp * ulysses):
        raise LayoutError(f"parallel.cp_ulysses: the {heads} query heads do not split over "
                          f"tp·ulysses = {tp}·{ulysses} ranks (Ulysses gives each rank whole "
                          "heads); choose tp·ulysses dividing them, or cp_algorithm ring")


@rule
def kv_heads_over_ulysses(m: ModelConfig, tp: int, ulysses: int) -> None:
    """Ulysses' K/V heads split over tp·ulysses ranks or are repeated up to it (as Megatron
    does): kv heads divide tp·ulysses or tp·ulysses divides them."""
    kv = m.num_attention_heads if m.kv_lora_rank else m.num_key_value_heads
    n = tp * ulysses
    if ulysses > 1 and kv % n and n % kv:
        raise LayoutError(f"parallel.cp_ulysses: the {kv} KV heads neither split over nor "
                          f"repeat up to tp·ulysses = {n} ranks; choose tp·ulysses a divisor "
                          f"or a multiple of {kv}, or cp_algorithm ring")


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
def cp_attention(m: ModelConfig, cp: int, ring: int = 0) -> None:
    """The ring's and the all-gather's attention (over ``ring`` ranks; cp when not given)
    computes neither a sliding window, another score scale nor latent attention; Ulysses
    runs the model's own attention over whole sequences, so it computes all three."""
    ring = cp if ring == 0 else ring
    for field in ("sliding_window", "query_pre_attn_scalar", "kv_lora_rank"):
        if ring > 1 and getattr(m, field):
            raise LayoutError(f"model.{field}: {getattr(m, field)}: ring and all-gather "
                              f"context parallelism (parallel.cp={cp}) do not compute this "
                              "attention; set parallel.cp_algorithm ulysses, or parallel.cp 1")


@rule
def mtp_without_cp(depth: int, cp: int) -> None:
    """Multi-token prediction embeds the tokens k ahead of each position: a cp rank's slice
    of the sequence does not hold them."""
    if depth and cp > 1:
        raise LayoutError(f"parallel.cp: {cp} with multi-token prediction "
                          f"(model.num_nextn_predict_layers={depth}) is not built yet (a rank's "
                          "slice lacks the tokens ahead); set parallel.cp 1")
