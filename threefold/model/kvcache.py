"""The key/value cache of incremental decoding (``threefold.generation.generate``): each layer's keys and
values of the positions seen so far, the positions of the next tokens and the mask that keeps
left padding out of attention. The model is unchanged without one."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding.

    ``CausalLM.forward(ids, cache=cache)`` attends the new tokens to every cached
    position and to themselves (causally), then appends their keys and values; without a cache
    the model is the training model, untouched. Buffers are allocated on first use with the
    shape the projections return (so a tensor-parallel shard caches its own heads) and
    ``max_len`` slots, so appending never copies what is cached.

    Rows may be left-padded: the first ``pad[b]`` slots of row b hold padding, which no query
    attends to and which do not count as positions (every row's first real token is at
    position 0), so a padded row computes what it would alone."""

    def __init__(self, batch: int, max_len: int, pad: torch.Tensor | None = None,
                 device: torch.device | str | None = None):
        self.max_len, self.length = max_len, 0
        self.pad = (torch.zeros(batch, dtype=torch.long, device=device) if pad is None
                    else torch.as_tensor(pad, dtype=torch.long, device=device))
        self.layers: list[LayerKV] = []

    def layer(self, i: int) -> "LayerKV":
        """Layer ``i``'s keys and values (created on first use)."""
        while len(self.layers) <= i:
            self.layers.append(LayerKV(self))
        return self.layers[i]

    def positions(self, t: int) -> torch.Tensor:
        """(B, t) RoPE positions of the next ``t`` tokens: slot index minus the row's padding
        (padding slots get 0; nothing attends to them)."""
        slots = torch.arange(self.length, self.length + t, device=self.pad.device)
        return (slots[None] - self.pad[:, None]).clamp_min(0)

    def attention_mask(self, t: int) -> torch.Tensor:
        """(B, 1, t, length + t) boolean mask of the next ``t`` queries: causal over slots,
        padding slots hidden. Each query also sees itself, so a padding query has one key
        (its output is never used, but a row of -inf would make NaNs that 0-weights cannot
        cancel in the value product)."""
        keys = torch.arange(self.length + t, device=self.pad.device)
        queries = keys[self.length:, None]
        visible = (keys[None] <= queries)[None] & (keys[None, None] >= self.pad[:, None, None])
        return (visible | (keys[None] == queries)[None])[:, None]

    def advance(self, t: int) -> None:
        """Count ``t`` more positions as cached (after every layer appended them)."""
        self.length += t


class LayerKV:
    """One layer's slice of a ``KVCache``: (B, kv heads, max_len, d) key and value buffers."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k = self.v = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values (B, kv heads, t, d) after the cached ones and return
        all of them (B, kv heads, length + t, d)."""
        start = self.cache.length
        end = start + k.shape[2]
        if end > self.cache.max_len:
            raise ValueError(f"KVCache: {end} positions exceed max_len={self.cache.max_len}")
        if self.k is None:  # (a value may be narrower than a key: latent attention's)
            self.k = k.new_zeros((*k.shape[:2], self.cache.max_len, k.shape[3]))
            self.v = v.new_zeros((*v.shape[:2], self.cache.max_len, v.shape[3]))
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]
