"""Parameters per rank: the pipeline split (the runtime's own, threefold.schedules.balance),
the units ZeRO shards, the gradient buckets data parallelism all-reduces, and which pipeline
stages differ. Exactly what the runtime builds, so the bytes it moves follow from these.
"""

from __future__ import annotations

from functools import lru_cache

from threefold.layout import Layout
from threefold.accounting.counts import tp_shard, tp_shard_for
from threefold.config import ModelConfig
from threefold.schedules.actions import rank_stage
from threefold.schedules.balance import split_counts


def shape_key(cfg: ModelConfig) -> tuple:
    """The numbers of ``cfg`` a stage's shapes depend on, as a hashable key for the caches:
    ``moe`` = (experts, top-k, shared width, dense first blocks, their width, shared expert
    gated), then ``attn`` = (head dim, q/k/v biases, q/k norms, norm layout, latent
    attention's widths), then the multi-token-prediction modules (D) last."""
    h, a, e = cfg.hidden_size, cfg.num_attention_heads, cfg.num_local_experts
    # moe_key and attn_key written out: a search asks for this key about a million times
    return (h, a, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size,
            cfg.num_hidden_layers, bool(cfg.tie_word_embeddings),
            (e, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size or 0,
             cfg.first_k_dense_replace, cfg.dense_intermediate_size,
             bool(cfg.shared_expert_gate)) if e else (0, 0, 0, 0, 0, True),
            attn_key(cfg), cfg.num_nextn_predict_layers)


def attn_key(cfg: ModelConfig) -> tuple:
    """(head dim, q/k/v biases, q/k norms: "" none, "head" or "projection", the norm layout,
    latent attention's (q latent, kv latent, features without and with RoPE, value width) or
    (), GPT-OSS's pieces (o_proj bias, sinks, router and expert biases)) of ``cfg``'s
    block."""
    mla = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
           cfg.v_head_dim) if cfg.kv_lora_rank else ()
    return (cfg.head_dim, bool(cfg.qkv_bias), cfg.qk_norm_over if cfg.qk_norm else "",
            cfg.norm_layout or "pre", mla,
            (bool(cfg.attention_out_bias), bool(cfg.attention_sinks), bool(cfg.moe_bias)))


def _latent_numels(h: int, heads: int, mla: tuple) -> tuple[int, ...]:
    """Latent attention's parameters on a rank of ``heads`` heads, in registration order
    (``threefold.model.mla``): q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
    kv_a_layernorm (whole on every tp rank), kv_b_proj, o_proj (this rank's heads)."""
    ql, c, nope, rope, v = mla
    q_rows = heads * (nope + rope)
    q = (ql * h, ql, q_rows * ql) if ql else (q_rows * h,)
    return (*q, (c + rope) * h, c, heads * (nope + v) * c, h * heads * v)


@lru_cache(maxsize=4096)
def _block_numels(h: int, a: int, kv: int, f: int, vocab: int, tp: int,
                  attn: tuple = ()) -> tuple[int, ...]:
    sh = tp_shard_for(h, a, kv, f, vocab, tp)
    hd, bias, qk_norm, layout, mla, oss = attn or (h // a, False, "", "pre", (), (False,) * 3)
    kv_rows = (kv * hd) if sh.kv_replicas > 1 else sh.kv_heads * hd  # replicated: whole
    q_rows = sh.heads * hd
    # registration order of threefold.model.decoder.DecoderLayer: input_layernorm (pre
    # layout), the attention's own sinks (GPT-OSS: this rank's heads; a module's own
    # parameters come before its children's), q/k/v_proj (each weight, then its bias),
    # o_proj (its bias whole on every rank), q/k_norm (per head: d; over the projection: this
    # rank's rows), post_attention_layernorm, gate/up/down_proj, post_feedforward_layernorm
    # (post and sandwich layouts)
    proj = [(q_rows * h, q_rows), (kv_rows * h, kv_rows), (kv_rows * h, kv_rows)]
    qkv = tuple(x for w, b in proj for x in ((w, b) if bias else (w,)))
    norms = {"": (), "head": (hd, hd), "projection": (q_rows, sh.kv_heads * hd)}[qk_norm]
    out = (h * q_rows, h) if oss[0] else (h * q_rows,)
    sinks = (sh.heads,) if oss[1] else ()
    attention = (*(_latent_numels(h, sh.heads, mla) if mla else (*sinks, *qkv, *out, *norms)),
                 h)
    mlp = (sh.ffn * h, sh.ffn * h, h * sh.ffn)
    if layout == "post":
        return (*attention, *mlp, h)
    if layout == "sandwich":  # (Gemma 3: pre_feedforward_layernorm before the MLP too)
        return (h, *attention, h, *mlp, h)
    return (h, *attention, *mlp)


@lru_cache(maxsize=4096)
def _layer_numels(h: int, a: int, kv: int, f: int, vocab: int, tp: int, moe: tuple, ep: int,
                  attn: tuple = (), dense: bool = False
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the block's parameters, its expert tensors held apart) on one tp and ep rank, in
    registration order. Dense (a dense model's, or with ``dense`` a mixture's dense first
    block, of its own width): (``_block_numels``, ()). A mixture of experts (HF Mixtral
    names, threefold.model.moe): the norms and attention, then ``mlp.gate`` (E·h),
    ``mlp.experts.gate_up_proj`` (E/ep·2f·h), ``mlp.experts.down_proj`` (E/ep·h·f), a shared
    expert (gate/up/down, then its 1×h gate when gated); the MoE is whole on every tp rank.
    With ep > 1 the two expert tensors are held apart (the runtime's engines treat them
    apart: their own ZeRO unit, their own gradient buckets), else they are in the block."""
    e, _, fs, _, dense_f, gated = moe
    if not e or dense:
        return _block_numels(h, a, kv, dense_f if e else f, vocab, tp, attn), ()
    block = _block_numels(h, a, kv, f, vocab, tp, attn)
    biased = bool(attn) and attn[5][2]  # GPT-OSS: the router's bias, then the experts'
    router = (e * h, e) if biased else (e * h,)
    experts = ((e // ep) * 2 * f * h, (e // ep) * h * f,
               *(((e // ep) * 2 * f, (e // ep) * h) if biased else ()))
    shared = (fs * h, fs * h, h * fs, *((h,) if gated else ())) if fs else ()
    post = (h,) if attn and attn[3] != "pre" else ()  # the norm after the MLP
    before = block[:len(block) - 3 - len(post)]
    if ep == 1:
        return before + router + experts + shared + post, ()
    return before + router + shared + post, experts


def block_parameter_numels(cfg: ModelConfig, tp: int) -> tuple[int, ...]:
    """Elements of each parameter of one block held by one tp rank, in the order the model
    registers them (a replicated k/v projection is held whole; a mixture of experts' every
    expert, as without expert parallelism; of a model with dense first blocks, a routed
    one)."""
    h, a, kv, f, vocab, _, _, moe, attn, _ = shape_key(cfg)
    return _layer_numels(h, a, kv, f, vocab, tp, moe, 1, attn)[0]


def _dense(moe: tuple, layer: int) -> bool:
    """Whether block ``layer`` of a mixture of experts is one of its dense first blocks."""
    return bool(moe[0]) and layer < moe[3]


def _block_flops(key: tuple, layer: int, t: int) -> float:
    """Training FLOPs per token of block ``layer`` at sequence length ``t``, as the runtime's
    ``stage_costs`` counts them: 6 per matmul weight a token uses (of a mixture of experts,
    the router's and its k routed experts' as well as the attention's and a shared
    expert's) and 6·T per query-and-value feature (12·H·Q·T when they are as wide)."""
    h, a, kv, f, vocab, _, _, moe, attn, _ = key
    hd, mla = attn[0], attn[4]
    if mla:
        ql, c, nope, rope, v = mla
        attention = (ql * h + ql * a * (nope + rope) if ql else h * a * (nope + rope)) \
            + (c + rope) * h + c * a * (nope + v) + a * v * h
        features = a * (nope + rope + v)
    else:
        attention, features = 2 * a * hd * h + 2 * kv * hd * h, 2 * a * hd
    if not moe[0] or _dense(moe, layer):
        mlp = 3 * h * (moe[4] if moe[0] else f)
    else:  # the router and the k experts a token is routed to, then a shared expert
        e, k, fs, _, _, gated = moe
        mlp = e * h + k * 3 * h * f + (3 * h * fs + (h if gated else 0) if fs else 0)
    return 6.0 * (attention + mlp) + 6.0 * features * t


@lru_cache(maxsize=4096)
def _virtual_stage_layers(key: tuple, n_stages: int, split: str = "params") -> tuple[int, ...]:
    h, a, kv, f, vocab, n_layers, tied, moe, attn, mtp = key
    emb = vocab * h
    if split.startswith("flops"):  # "flops:T", as stage.stage_costs counts them at length T
        try:
            t = int(split.split(":")[1])
        except (IndexError, ValueError):
            raise ValueError(f"pipeline_split '{split}': the planner needs 'flops:SEQ_LEN'") \
                from None
        # each multi-token-prediction module on the last stage: its block, eh_proj, the head
        last = 6.0 * emb * (1 + mtp) + mtp * (_block_flops(key, n_layers, t) + 12.0 * h * h)
        return split_counts("flops", [_block_flops(key, i, t) for i in range(n_layers)],
                            n_stages, 0.0, last)
    layers = [float(sum(_layer_numels(h, a, kv, f, vocab, 1, moe, 1, attn,
                                      _dense(moe, i))[0])) for i in range(n_layers)]
    modules = mtp * float(sum(_mtp_numels(key, 1, 1)[0]) + (emb if mtp else 0))
    return split_counts(split, layers, n_stages, float(emb),
                        float(h + (0 if tied else emb)) + modules)


def _mtp_numels(key: tuple, tp: int, ep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One multi-token-prediction module's parameters on one tp and ep rank, in registration
    order (its block's, a routed one in a mixture, then enorm, hnorm, eh_proj (2h·h, whole on
    every tp rank) and shared_head.norm), and its expert tensors held apart (ep > 1)."""
    h, a, kv, f, vocab, n_layers, _, moe, attn, _ = key
    block, experts = _layer_numels(h, a, kv, f, vocab, tp, moe, ep, attn,
                                   _dense(moe, n_layers))
    return block + (h, h, 2 * h * h, h), experts


def pipeline_layers(cfg: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Blocks of each of the ``pp·vpp`` virtual stages, split as the runtime splits the model
    (``threefold.parallel.pipeline.stage.split_model`` with ``parallel.pipeline_split``: by
    default balanced by parameters, the embedding counted on the first stage, the final norm
    and an untied head on the last; "flops:T" balanced by training FLOPs at sequence length
    T; uniform; or given counts), so that every per-stage figure here is that of the stage a
    run builds."""
    return _virtual_stage_layers(shape_key(cfg), layout.pp * layout.vpp, layout.pipeline_split)


def rank_layers(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Blocks one rank of pipeline ``stage`` holds: its ``vpp`` chunks (virtual stages
    ``c·pp + stage``, or in a V stages ``stage`` and ``2pp - 1 - stage``) together."""
    return _rank_layers(shape_key(cfg), layout.pp, layout.vpp, layout.pipeline_split, stage,
                        layout.vshape)


@lru_cache(maxsize=65536)
def _rank_layers(key: tuple, p: int, v: int, split: str, stage: int,
                 vshape: bool = False) -> int:
    counts = _virtual_stage_layers(key, p * v, split)
    return sum(counts[rank_stage(stage, c, p, vshape)] for c in range(v))


@lru_cache(maxsize=65536)
def _rank_layer_ids(key: tuple, p: int, v: int, split: str, stage: int,
                    vshape: bool = False) -> tuple[int, ...]:
    """The blocks one rank of ``stage`` holds, chunk by chunk (the order its merged model
    registers them in)."""
    counts = _virtual_stage_layers(key, p * v, split)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return tuple(i for c in range(v) for s in [rank_stage(stage, c, p, vshape)]
                 for i in range(starts[s], starts[s] + counts[s]))


def rank_moe_chunks(cfg: ModelConfig, layout: Layout, stage: int) -> tuple[int, ...]:
    """The mixture-of-experts blocks in each chunk one rank of ``stage`` holds (its router
    losses are taken chunk by chunk); () for a dense model."""
    key = shape_key(cfg)
    if not cfg.num_local_experts:
        return ()
    p, v = layout.pp, layout.vpp
    counts = _virtual_stage_layers(key, p * v, layout.pipeline_split)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return tuple(sum(not _dense(key[7], i) for i in range(starts[s], starts[s] + counts[s]))
                 for c in range(v) for s in [rank_stage(stage, c, p, layout.vshape)])


def rank_dense_layers(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Of the blocks one rank of ``stage`` holds, the dense first blocks of a mixture of
    experts (DeepSeek-V3's ``first_k_dense_replace``); 0 for any other model."""
    key = shape_key(cfg)
    return sum(_dense(key[7], i) for i in _rank_layer_ids(
        key, layout.pp, layout.vpp, layout.pipeline_split, stage, layout.vshape))


@lru_cache(maxsize=65536)
def _stage_units(key: tuple, tp: int, p: int, v: int, split: str, stage: int, ep: int = 1,
                 vshape: bool = False) -> tuple[tuple[int, ...], ...]:
    h, a, kv, f, vocab, n_layers, tied, moe, attn, mtp = key
    emb = tp_shard_for(h, a, kv, f, vocab, tp).vocab * h
    shared = tied and p == 1  # one weight; pipelined, the head is a copy (a V's on rank 0 too)
    units: list[tuple[int, ...]] = []
    if stage == 0 and not shared:
        units.append((emb,))
    units += [_layer_numels(h, a, kv, f, vocab, tp, moe, ep, attn, _dense(moe, i))[0]
              for i in _rank_layer_ids(key, p, v, split, stage, vshape)]
    if stage == (0 if vshape else p - 1):
        # the multi-token-prediction modules, and the copy of the embedding they embed with
        units += [_mtp_numels(key, tp, ep)[0]] * mtp + ([(emb,)] if mtp and p > 1 else [])
        units.append((h,))
        if not shared:
            units.append((emb,))
    if shared and stage == 0:
        units.append((emb,))  # the shared weight: ZeRO's root unit, registered first
    return tuple(units)


def stage_units(cfg: ModelConfig, layout: Layout, stage: int) -> tuple[tuple[int, ...], ...]:
    """The parameters one rank of pipeline ``stage`` holds, grouped as threefold's ZeRO engine
    groups them into units, in forward order: the embedding, each block, the final norm, the
    LM head (each a tuple of parameter sizes in registration order). With tied embeddings on
    one stage the shared weight is one *root* unit, listed last (``ZeroEngine`` does so); in
    registration order it comes first (``parameter_numels``). Under expert parallelism
    (ep > 1) a block's expert tensors are not in its unit: ``stage_expert_units``."""
    return _stage_units(shape_key(cfg), layout.tp, layout.pp, layout.vpp,
                        layout.pipeline_split, stage, layout.ep, layout.vshape)


def stage_expert_units(cfg: ModelConfig, layout: Layout, stage: int
                       ) -> tuple[tuple[int, ...], ...]:
    """Under expert parallelism (ep > 1), the expert tensors one rank of ``stage`` holds,
    one unit per block (gate_up_proj, down_proj of its E/ep experts): the runtime's ZeRO
    shards each over "edp_shard" (padded to a multiple of dp_shard/ep), its data parallelism
    all-reduces them over "edp" in buckets of their own. () without ep (the experts are then
    in their blocks' units) or for a dense model."""
    h, a, kv, f, vocab, _, _, moe, attn, mtp = shape_key(cfg)
    experts = _layer_numels(h, a, kv, f, vocab, layout.tp, moe, layout.ep, attn)[1]
    if not experts:
        return ()
    last = stage == (0 if layout.vshape else layout.pp - 1)  # with the modules' blocks
    return (experts,) * (rank_layers(cfg, layout, stage) - rank_dense_layers(cfg, layout, stage)
                         + (mtp if last else 0))


def parameter_numels(cfg: ModelConfig, layout: Layout, stage: int = 0) -> list[int]:
    """Sizes of the parameters one rank of ``stage`` holds, in the model's registration order
    (embedding, blocks, final norm, LM head; a tied weight once, first): the order
    ``threefold.parallel.engines.data_parallel`` cuts gradient buckets in."""
    units = list(stage_units(cfg, layout, stage))
    if cfg.tie_word_embeddings and layout.pp == 1:
        units = [units[-1]] + units[:-1]
    return [n for unit in units for n in unit]


def owned_parameters(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters one rank of ``stage`` updates: all it holds, or under ZeRO its shard of
    each unit (padded to a multiple of dp_shard·cp, as ``threefold.parallel.engines.zero`` pads; an
    expert unit to a multiple of dp_shard/ep, its shard group)."""
    n = layout.shard_size if layout.zero_stage else 1
    ne = layout.edp_shard if layout.zero_stage else 1
    return sum(-(-sum(u) // n) for u in stage_units(cfg, layout, stage)) \
        + sum(-(-sum(u) // ne) for u in stage_expert_units(cfg, layout, stage))


def stage_parameters(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` (tp-sharded, vocabulary padded;
    of a mixture of experts, the rank's E/ep experts per block)."""
    return sum(sum(u) for u in stage_units(cfg, layout, stage)) \
        + sum(sum(u) for u in stage_expert_units(cfg, layout, stage))


def largest_unit_parameters(cfg: ModelConfig, tp: int) -> int:
    """Largest unit of weights ZeRO-3 gathers at once on one rank: a transformer block or the
    embedding/head shard (DeepSpeed's 'largest layer'); without expert parallelism."""
    return max(sum(block_parameter_numels(cfg, tp)), tp_shard(cfg, tp).vocab * cfg.hidden_size)


@lru_cache(maxsize=4096)
def cut_buckets(numels: tuple[int, ...], elem: int, bucket_bytes: int) -> tuple[int, ...]:
    """Elements of each bucket when ``numels`` (registration order) are taken in reverse and a
    bucket is closed once it holds ``bucket_bytes`` of ``elem``-byte elements."""
    out, cur = [], 0
    for n in reversed(numels):
        cur += n
        if cur * elem >= bucket_bytes:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return tuple(out)


def gradient_buckets(cfg: ModelConfig, layout: Layout, elem_bytes: int, stage: int = 0
                     ) -> tuple[int, ...]:
    """Elements of each data-parallel gradient bucket, cut as ``threefold.parallel.engines.data_parallel``
    cuts them: parameters in reverse registration order, a bucket closed once it reaches
    ``layout.bucket_bytes``."""
    return cut_buckets(tuple(parameter_numels(cfg, layout, stage)), elem_bytes, layout.bucket_bytes)


@lru_cache(maxsize=4096)
def stage_representatives(key: tuple, p: int, v: int, split: str, vshape: bool = False
                          ) -> tuple[int, ...]:
    """For each pipeline stage, the first stage of its kind (first, last, or a middle one with
    the same block count): stages of one kind have the same costs."""
    first: dict[tuple, int] = {}
    last = 0 if vshape else p - 1
    return tuple(first.setdefault((st == 0, st == last,
                                   _rank_layers(key, p, v, split, st, vshape),
                                   sum(_dense(key[7], i) for i in _rank_layer_ids(
                                       key, p, v, split, st, vshape))), st)
                 for st in range(p))


def distinct_stages(cfg: ModelConfig, layout: Layout) -> list[int]:
    """One stage for each kind of pipeline rank: the first, the last, and one per distinct
    block count in between (all alike when the split is even)."""
    return sorted(set(stage_representatives(shape_key(cfg), layout.pp, layout.vpp,
                                             layout.pipeline_split, layout.vshape)))


def stage_multiplicity(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    """How many stages the representative ``stage`` stands for."""
    return stage_representatives(shape_key(cfg), layout.pp, layout.vpp,
                                  layout.pipeline_split, layout.vshape).count(stage)
