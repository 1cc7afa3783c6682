"""Tiled MLP (``train.mlp_tiles``, the tiled MLP of Snowflake's Arctic Long Sequence Training,
arXiv 2506.13996): each dense block's MLP runs over the sequence in N tiles, each under a
non-reentrant checkpoint, so what it keeps for backward is its input alone and backward
recomputes one tile's gate, up and SwiGLU product at a time.

Untiled, a block's MLP keeps per token its input as the linears see it and SwiGLU's gate, up
and product (3·ffn values: with ffn ≈ 3.5·h, most of a block's activations); tiled, only the
input (the tiles are views of it), and the recompute's transient is one tile's share. The
price is the MLP's forward once more in backward (its FLOPs, 2·3·h·ffn per token). Tokens are
independent in an MLP, so the result is the untiled one.

The tiles sit inside tensor parallelism's conjugate operators (the wrapper is applied first):
the all-gather and reduce-scatter of sequence parallelism run once per block on the whole
input, never in the recompute. Mixture-of-experts blocks are not tiled (the rule book
refuses ``train.mlp_tiles`` for them), nor under selective recompute or overlapped tensor
parallelism, whose projections do not take their input tile by tile.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from threefold.model.decoder import MLP
from threefold.parallel.transforms.wrap import wrap


class TiledMLP(MLP):
    """An ``MLP`` run over ``tiles`` slices of the sequence, each recomputed in backward."""

    tiles = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, h) -> (B, T, h), tile by tile along T (at most T tiles)."""
        run = super().forward
        parts = x.tensor_split(min(self.tiles, x.shape[1]), dim=1)
        return torch.cat([checkpoint(run, p, use_reentrant=False) for p in parts], dim=1)

    def extra_repr(self) -> str:
        return f"{self.tiles} tiles along the sequence, each recomputed in backward"


def apply_mlp_tiles(model: torch.nn.Module, tiles: int) -> torch.nn.Module:
    """Tile every dense ``MLP`` of ``model`` (in place) when ``tiles`` > 1."""
    if tiles > 1:
        for mod in list(model.modules()):
            if isinstance(mod, MLP):
                wrap(mod, TiledMLP, tiles=tiles)
    return model
