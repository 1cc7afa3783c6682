"""What the multi-token-prediction modules (``threefold.model.mtp``) keep for backward on the
last pipeline stage, per microbatch: the planner's and the dry run's figure, equal to
autograd's saved tensors (``tests/test_mtp.py`` measures it)."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.accounting import local_seq_len
from threefold.layout import Layout, Workload
from threefold.plan.activations import model_layer_activation_bytes


def mtp_activation_bytes(cfg: ModelConfig, layout: Layout, work: Workload) -> float:
    """Bytes the D modules keep per microbatch on one rank of the last stage. Per token and
    module, beyond its block's (``model_layer_activation_bytes``; under full recompute the
    checkpoint's inputs instead):

    - the embedding of the tokens ahead keeps their ids (int64, 8 bytes; under tp also the
      1-byte mask of ids outside the rank's vocabulary rows);
    - ``enorm`` its input (the embedding, r·h) and 1/rms (4); ``hnorm`` 1/rms only (its input
      is the previous depth's state, which that depth's norm already keeps);
    - ``eh_proj`` its input, the concatenation (2·d·h);
    - ``shared_head.norm`` its input (r·h) and 1/rms (4); the head its normed input (d·h),
      the labels ahead (int64) and the fp32 log-sum-exp (``threefold.model.head_loss``).

    Under sequence parallelism the norms and ``eh_proj`` see 1/t of the tokens; the head's
    input is gathered whole. Under full recompute the module's block, norms and projection
    keep only the checkpoint's inputs: the embedding (r·h) and, beyond depth 1, the
    previous depth's state (r·h; depth 1's is the main model's, kept by the final norm).
    Selective keeps the same plus its block's selective bytes (``eh_proj``'s output, a
    matmul's, is the block's input those count)."""
    depth = cfg.num_nextn_predict_layers
    if not depth:
        return 0.0
    h, d, r = cfg.hidden_size, work.act_bytes, work.resid_bytes
    tokens = layout.microbatch_size * local_seq_len(layout, work)
    split = layout.tp if layout.sp else 1
    ids = 8 + (1 if layout.tp > 1 else 0)
    head = d * h + 8 + 4
    if layout.recompute != "none":
        inputs = tokens * (depth * (ids + r * h / split + head) + (depth - 1) * r * h / split)
        if layout.recompute == "full":
            return inputs
        return inputs + depth * model_layer_activation_bytes(cfg, layout, work)
    norms = (2 * (r * h + 4) + 4) / split
    module = ids + norms + 2 * d * h / split + head
    return depth * (tokens * module + model_layer_activation_bytes(cfg, layout, work))
