"""What attention with sinks (GPT-OSS, ``threefold.model.attention.sink_attention``) keeps for
backward beyond the fused kernel's count in ``threefold.plan.activations``: no fused kernel
takes the sink's extra logit, so the scores are made whole.
"""

from __future__ import annotations

from threefold.accounting import local_seq_len, tp_shard
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload


def sink_attention_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """One block's attention with sinks, per rank and microbatch, less what
    ``block_activation_bytes`` counts for the fused kernel (whose 4-byte log-sum-exp per head
    it does not keep), in place of ``block_document_mask_bytes``. Per token: K and V repeated
    to the query heads, d·2·(heads − kv heads)·head_dim, and the softmax's fp32 output over
    the keys and the sink, 4·heads·(s + 1), with its copy in d bytes below fp32
    (d·heads·s); once per block the boolean mask it fills (s² bytes,
    b·s² with packed documents: the causal mask it builds, the window's, or the documents').
    Measured to the byte against autograd's saved tensors (fp32 and bf16 autocast,
    tests/test_gpt_oss.py). Heads are this tp rank's."""
    sh, b = tp_shard(cfg, layout.tp), layout.microbatch_size
    s, d = local_seq_len(layout, work), work.act_bytes
    probs = 4 * (s + 1) + (d * s if d != 4 else 0)  # fp32, and its cast for the product
    per_token = d * 2 * (sh.heads - sh.kv_heads) * cfg.head_dim + sh.heads * (probs - 4)
    return float(b * s * per_token + (b if work.document_mask else 1) * s * s)


def selective_sink_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """What selective recompute keeps less with sinks than ``selective_block_bytes`` counts
    (a negative number): it keeps the fused kernel's output and log-sum-exp, d·head_dim + 4
    per head and token, but the sink attention's products are no kernel it keeps
    (``threefold.parallel.transforms.recompute``): they are recomputed with the scores."""
    sh, b = tp_shard(cfg, layout.tp), layout.microbatch_size
    tokens = b * local_seq_len(layout, work)
    return -float(tokens * sh.heads * (work.act_bytes * cfg.head_dim + 4))
