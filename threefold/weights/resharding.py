"""Resharding, the writing side: where each piece a rank holds sits in its logical tensor
(tensor-parallel slice, expert run, ZeRO flat range), and which rank writes a replicated
tensor, so that a checkpoint written by one layout loads into any other (the reading side is
``threefold.parallel.materialize`` over ``threefold.weights``).

It imports nothing of ``threefold.parallel``, which calls it (``Distributed``): what it needs
to know of the engine's parameters, their placement records and whether the engine holds
ZeRO shards, the caller passes in."""

from __future__ import annotations


def rank_pieces(engine, dims, rank: int, data_axis: str, placements: dict,
                zero: bool) -> list:
    """The pieces ``rank`` (of the mesh ``dims``) writes of what ``engine`` holds, each
    replicated tensor written by one rank only: ZeRO shards (``zero``: the engine is a
    ``ZeroEngine``) by the first replica group,
    data-parallel copies by dp rank 0 (over ``data_axis``; a rank's experts over "edp"),
    tp-replicated tensors by tp rank 0; tp slices and expert runs get their place in the
    logical tensor (``placements``: each of the engine's parameters' record by name,
    ``threefold.parallel.placement.placement``). Context-parallel ranks hold copies (or,
    under ZeRO, shards of the dp_shard × cp group) as data-parallel ones do."""
    c = dims.coords(rank)
    if zero and c["dp_replicate"] != 0:
        return []
    params = dict(engine.named_params)
    t, out = dims.tp, []
    for piece in engine.local_pieces():
        p = params[piece.name]
        rec = placements[piece.name]
        if rec.tied_replica:
            continue  # a tied head's copy: the embedding, saved by the first stage
        expert = rec.ep_sharded
        if not zero and c["edp" if expert else data_axis] != 0:
            continue  # a data-parallel copy (of this rank's experts: over edp)
        if expert:  # this ep rank's experts: a contiguous run of the whole tensor
            off = rec.ep_index * p.numel()
            piece.start, piece.end = piece.start + off, piece.end + off
            piece.shape = (p.shape[0] * rec.ep_count, *p.shape[1:])
        dim = rec.tp_dim if t > 1 else None
        if dim is None:
            if c["tp"] == 0:
                out.append(piece)
            continue
        shape = list(piece.shape)
        shape[dim] = rec.tp_full
        piece.shape, piece.tp_dim, piece.tp_index, piece.tp_count = (tuple(shape), dim,
                                                                     c["tp"], t)
        out.append(piece)
    return out
