"""Which blocks each pipeline stage holds: the balanced split of the layers, in pure Python so
that the planner (threefold.accounting) splits a model exactly as the runtime (stage.py) does,
without building it.

The L transformer blocks go to ``S = p·v`` virtual stages in contiguous runs of at least one
block each; the first stage also holds the embedding and the last the final norm and the head,
given as extra cost on those two stages. Among splits, the one with the smallest largest stage
cost wins (the pipeline's bottleneck), then the most even one.
"""

from __future__ import annotations

from threefold.config import ConfigError


def _check_fill(n_layers: int, n_stages: int) -> None:
    """Every stage needs at least one block."""
    if n_stages < 1:
        raise ValueError(f"pipeline: need at least one stage, got {n_stages}")
    if n_layers < n_stages:
        raise ConfigError(f"model.num_hidden_layers: {n_layers} layers cannot fill {n_stages} "
                          f"pipeline stages (pp·vpp) with at least one layer each; lower "
                          f"parallel.pp or parallel.vpp, or use a deeper model")


def partition(layer_costs: list[float], n_stages: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[range]:
    """Split the blocks, with the given costs, into ``n_stages`` contiguous runs of at least
    one block that minimise the largest stage cost (blocks plus the first/last extras); among
    those, the one with the smallest sum of squared stage costs, then the one whose later
    stages are larger (the first stage holds the most activations under 1F1B)."""
    n_layers = len(layer_costs)
    _check_fill(n_layers, n_stages)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, a: int, b: int) -> float:
        return (prefix[b] - prefix[a] + (first_extra if stage == 0 else 0.0)
                + (last_extra if stage == n_stages - 1 else 0.0))

    # 1) the smallest achievable bottleneck, by dynamic programming over prefixes
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    for b in range(1, n_layers + 1):
        best[0][b] = cost(0, 0, b)
    for k in range(1, n_stages):
        for b in range(k + 1, n_layers + 1):
            best[k][b] = min(max(best[k - 1][a], cost(k, a, b)) for a in range(k, b))
    bound = best[n_stages - 1][n_layers] * (1 + 1e-12)
    # 2) under that bound, the most even split (smallest sum of squares)
    sq = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages)]
    for b in range(1, n_layers + 1):
        if cost(0, 0, b) <= bound:
            sq[0][b] = cost(0, 0, b) ** 2
    for k in range(1, n_stages):
        for b in range(k + 1, n_layers + 1):
            for a in range(k, b):  # ascending a: on ties the later stage gets more blocks
                c = cost(k, a, b)
                if c <= bound and sq[k - 1][a] + c * c < sq[k][b] * (1 - 1e-12):
                    sq[k][b], cut[k][b] = sq[k - 1][a] + c * c, a
    bounds, b = [n_layers], n_layers
    for k in range(n_stages - 1, 0, -1):
        b = cut[k][b]
        bounds.append(b)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def uniform_counts(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """``n_layers / n_stages`` blocks per stage (Megatron's split, which ignores the embedding
    and the head); a remainder goes one block each to the stages nearest the middle, away
    from the ends that already hold the embedding and the head, later ones first."""
    _check_fill(n_layers, n_stages)
    base, extra = divmod(n_layers, n_stages)
    # nearest the middle first; on a tie the later stage (the first keeps the most
    # microbatches in flight under 1F1B)
    middle = sorted(range(n_stages), key=lambda i: (abs(2 * i - (n_stages - 1)), -i))
    more = set(middle[:extra])
    return tuple(base + (i in more) for i in range(n_stages))


def explicit_counts(text: str, n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Blocks per virtual stage as written in ``parallel.pipeline_split`` ("7,9,9,7"):
    ``n_stages`` positive counts that add up to ``n_layers``, or a ConfigError that says
    what to write."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != n_stages or min(counts, default=0) < 1 or sum(counts) != n_layers:
        raise ConfigError(f"parallel.pipeline_split: '{text}' must be params, flops, uniform or "
                          f"{n_stages} positive block counts (one per pipeline stage, pp·vpp) "
                          f"adding up to the model's {n_layers} layers, e.g. "
                          f"'{','.join(map(str, uniform_counts(n_layers, n_stages)))}'")
    return counts


def split_counts(split: str, layer_costs: list[float], n_stages: int,
                 first_extra: float = 0.0, last_extra: float = 0.0) -> tuple[int, ...]:
    """Blocks per virtual stage for ``parallel.pipeline_split``: "params" or "flops"
    (``partition`` of the given costs: parameters, the runtime's default, or training FLOPs),
    "uniform" or explicit counts."""
    if split == "uniform":
        return uniform_counts(len(layer_costs), n_stages)
    if split[:1].isdigit():
        return explicit_counts(split, len(layer_costs), n_stages)
    if split not in ("params", "flops"):
        raise ConfigError(f"parallel.pipeline_split: '{split}' is not params, flops, uniform "
                          "or a list of block counts such as '7,9,9,7'")
    return tuple(len(r) for r in partition(layer_costs, n_stages, first_extra, last_extra))


def runs_of(counts: tuple[int, ...]) -> list[range]:
    """The contiguous block ranges of the given per-stage counts."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out
