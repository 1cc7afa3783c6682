"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2; Megatron's MTP): ``D`` modules
after the last block, each predicting one more token ahead.

Module k (1 ≤ k ≤ D) at position i combines the previous depth's hidden state ``h^{k-1}_i``
(for k = 1 the main model's last block's output, before the final norm, as DeepSeek's figure 3
draws it: the output head, norm included, is what the modules share) with the embedding of
token i + k:

    h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]     (``eh_proj``: 2h -> h)
    h^k_i = Block_k(h'_i)
    P^k_{i} = Head(RMSNorm_k(h^k_i))                          (predicts t_{i+k+1})

The concatenation puts the embedding first, as the published checkpoint's ``eh_proj`` (and
Megatron's) are laid out. The embedding and the head's matrix are the main model's own
(``model.embed_tokens``, ``lm_head``); the norm before the head is the module's
(``shared_head.norm``). Parameter names are those of DeepSeek-V3's checkpoint, where module
k is block ``num_hidden_layers + k - 1``: ``enorm``, ``hnorm``, ``eh_proj``, the block's own
weights and ``shared_head.norm`` (the files' copies of the embedding and the head,
``embed_tokens`` and ``shared_head.head``, are read and written by ``threefold.weights``).

Loss: λ/D · Σ_k Σ_i CE(P^k_i, t_{i+k+1}) over the positions whose target exists, divided
like the main loss by the step's target tokens (DeepSeek's 1/T). The module records each
depth's summed cross-entropy on the model during a training forward with labels; the
step's model hook (``threefold.model.moe.RouterLog.add``) takes it into the objective.

Being blocks of ``model.layers`` (after the main ones), the modules are split by tensor
and expert parallelism, recomputed, compiled and sharded by ZeRO as every block is; a
pipeline places them on the last stage, with the head.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.norm import RMSNorm


class SharedHead(nn.Module):
    """The module's own norm before the shared head (DeepSeek's ``shared_head.norm``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one,
                            cfg.norm_fp32_weight)


class MultiTokenPrediction:
    """Mixed into a family's block class (``mtp_block_class``): the block plus the module's
    input projection and norms. ``forward(h, cos, sin, mask, embedded=e)`` returns (h^k, its
    norm before the head)."""

    mtp_depth = 0  # k, from 1

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        h, eps, one = cfg.hidden_size, cfg.rms_norm_eps, (cfg.norm_plus_one,
                                                          cfg.norm_fp32_weight)
        self.mtp_depth = layer - cfg.num_hidden_layers + 1
        self.enorm = RMSNorm(h, eps, *one)
        self.hnorm = RMSNorm(h, eps, *one)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg)

    def residual_norms(self) -> list[RMSNorm]:
        """The block's norms over the residual width, the module's own included."""
        return super().residual_norms() + [self.shared_head.norm]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None = None, embedded: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h^{k-1} (B, T, h) and the embeddings of the tokens k ahead -> (h^k, its norm)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        out = super().forward(x, cos, sin, attn_mask)
        return out, self.shared_head.norm(out)


@functools.cache
def mtp_block_class(block: type) -> type:
    """``block`` (a family's block class) as a multi-token-prediction module, made once and
    registered here by name so that models pickle."""
    name = block.__name__.removesuffix("DecoderLayer") + "MultiTokenPredictionLayer"
    cls = type(name, (MultiTokenPrediction, block),
               {"__module__": __name__, "__qualname__": name,
                "__doc__": f"A multi-token-prediction module over {block.__name__}."})
    globals()[name] = cls
    return cls


def is_mtp(layer: nn.Module) -> bool:
    """Whether a block of ``model.layers`` is a multi-token-prediction module."""
    return isinstance(layer, MultiTokenPrediction)


def mtp_depth(model: nn.Module) -> int:
    """How many multi-token-prediction modules ``model`` holds (each calls the head once
    more per training forward)."""
    return sum(map(is_mtp, model.modules()))


def ahead(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``t`` (B, T, ...) moved k positions back along T: position i holds t[:, i + k]; the
    last k positions hold ``fill``."""
    pad = torch.full((t.shape[0], k, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t[:, k:], pad], dim=1)


def run_modules(layers, embed, h: torch.Tensor, ids: torch.Tensor, rope, masks, scale: float
                ) -> list[torch.Tensor]:
    """The D modules in ``layers`` from the main model's last hidden state ``h`` (un-normed)
    and the token ids (B, T) of the whole sequence: each depth's normed output, the head's
    input. ``embed`` is the embedding module (vocab-parallel and sequence-split under tensor
    parallelism: then each rank embeds its own positions of the shifted tokens), ``rope``
    (global, local) cos/sin pairs and ``masks`` (full, windowed) as the blocks take them;
    ``scale`` the embedding's multiplier (Gemma's sqrt(h)) or 0."""
    out = []
    for layer in layers:
        e = embed(ahead(ids, layer.mtp_depth, 0))
        if scale:
            e = e * torch.tensor(scale, dtype=e.dtype)
        slide = layer.self_attn.window
        # (e positional: a recomputing block's checkpoint saves it as it saves h)
        h, normed = layer(h, *(rope[1] if slide else rope[0]),
                          masks[1] if slide else masks[0], e)
        out.append(normed)
    return out


def depth_losses(head, states: list[torch.Tensor], labels: torch.Tensor,
                 temperature: float = 1.0) -> list[torch.Tensor]:
    """Each depth's summed cross-entropy: depth k's prediction at position i against the
    label of position i + k (the token i + k + 1), none where that is past the sequence."""
    return [head(s, labels=ahead(labels, k, -100), temperature=temperature).sum()
            for k, s in enumerate(states, start=1)]


def take_mtp_losses(model: nn.Module) -> list[torch.Tensor] | None:
    """The per-depth summed losses the model's last training forward recorded, taken (None
    where it recorded none: no modules here, or no labels)."""
    for m in model.modules():
        losses = getattr(m, "mtp_losses", None)
        if losses:
            m.mtp_losses = None
            return losses
    return None
