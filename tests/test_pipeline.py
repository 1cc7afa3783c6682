"""Pipeline parallelism at run time: the stage split (balanced, HF names, refusals), the split
backward (B then W equals one backward), and every schedule at pp 2 and 4 training to the same
losses and weights as one process, alone and with data parallelism or ZeRO; plus the measured
trace."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from tests.dist import run_distributed
from threefold.config import ConfigError, ModelConfig, OptimConfig
from threefold.model.decoder import CausalLM, causal_lm_loss
from threefold.parallel.pipeline.executor import PipelineExecutor, idle_fraction, pipeline_step
from threefold.parallel.pipeline.split_backward import SplitBackward
from threefold.schedules import build_schedule
from threefold.schedules.registry import schedule_spec
from threefold.schedules.balance import partition
from threefold.parallel.pipeline.stage import rank_model, split_model, stage_costs
from threefold.schedules.timeline import write_chrome_trace

SEED, VOCAB, SEQ, BATCH, STEPS, LR = 0, 320, 32, 8, 3, 3e-3


def _cfg(layers: int = 8, **kw) -> ModelConfig:
    """The tests' tiny shape (conftest's tiny_overrides), deeper so that pp·vpp chunks fit."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2)
    return ModelConfig(**{**base, **kw}).resolved(VOCAB)


def _model(cfg: ModelConfig) -> CausalLM:
    """The whole model, initialised by name from SEED. (Built on the CPU: initialising on the
    meta device imports torch's compiler stack, seconds in every test process.)"""
    model = CausalLM(cfg)
    model.init_weights(SEED)
    return model


def _materialise(chunks):
    """Chunks given fresh storage and initialised alone, by name (as train.py would after
    cutting a model built on the meta device)."""
    for c in chunks:
        c.to_empty(device="cpu")
        c.init_weights(SEED)
    return chunks


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: a second OpenMP thread only spins (badly so on a shared 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[step % BATCH, : SEQ // 2] = -100  # some tokens without a target
    return ids, labels


def _optim() -> OptimConfig:
    return OptimConfig(lr=LR, grad_clip=0.0, warmup_steps=0)


# --------------------------------------------------------------------------------------------
# Stage split
# --------------------------------------------------------------------------------------------
def _stage_cost(costs, run, i, n_stages, first, last):
    return sum(costs[j] for j in run) + (first if i == 0 else 0) + \
        (last if i == n_stages - 1 else 0)


def _brute_force_bottleneck(costs, n_stages, first, last):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        b = [0, *cuts, len(costs)]
        best = min(best, max(_stage_cost(costs, range(b[i], b[i + 1]), i, n_stages, first,
                                         last) for i in range(n_stages)))
    return best


@pytest.mark.parametrize("costs,n_stages,first,last", [
    ([1] * 8, 2, 0, 0), ([1] * 7, 3, 0, 0), ([1] * 8, 4, 2.5, 0), ([1] * 9, 3, 0, 3.2),
    ([1] * 10, 4, 1.7, 2.2), ([1] * 12, 5, 6, 6), ([1] * 6, 6, 9, 9),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 4, 2, 7), ([2, 7, 1, 8, 2, 8, 1, 8], 3, 0, 0)])
def test_partition_is_optimal_and_covers_every_layer(costs, n_stages, first, last):
    runs = partition(costs, n_stages, first, last)
    assert len(runs) == n_stages and all(len(r) >= 1 for r in runs)
    assert [i for r in runs for i in r] == list(range(len(costs)))  # contiguous, in order
    worst = max(_stage_cost(costs, r, i, n_stages, first, last) for i, r in enumerate(runs))
    assert worst == pytest.approx(_brute_force_bottleneck(costs, n_stages, first, last))


def test_balance_by_params_and_by_flops():
    layers, first, last = stage_costs(_model(_cfg(layers=4)))
    assert layers == [36992] * 4 and (first, last) == (320 * 64, 64 + 320 * 64)  # weights
    assert [list(r) for r in partition(layers, 2, first, last)] == [[0, 1], [2, 3]]
    # A large vocabulary: by parameters both ends (embedding, head) take fewer blocks; by FLOPs
    # the embedding lookup is free, so only the last stage (the head's matmul) is lighter.
    big = _model(_cfg(layers=12, vocab_size=4096))
    by_params = _split_sizes(stage_costs(big, "params"), 4)
    by_flops = _split_sizes(stage_costs(big, "flops", seq_len=SEQ), 4)
    assert by_params[0] < by_params[1] and by_params[-1] < by_params[1]
    assert by_flops[-1] < min(by_flops[:-1]) and by_flops[0] > by_params[0]
    from threefold.accounting import flops_per_token  # the same PaLM count as the cost model

    layers, first, last = stage_costs(big, "flops", seq_len=SEQ)
    assert sum(layers) + first + last == flops_per_token(big.cfg, SEQ)
    with pytest.raises(ValueError, match="balance"):
        stage_costs(big, "memory")


def _split_sizes(costs, n_stages):
    layers, first, last = costs
    return [len(r) for r in partition(layers, n_stages, first, last)]


def test_split_refuses_impossible_layouts():
    with pytest.raises(ConfigError, match="num_hidden_layers: 4 layers cannot fill 8"):
        split_model(_model(_cfg(layers=4)), p=4, v=2, pp_rank=0)
    with pytest.raises(ValueError, match="pp_rank"):
        split_model(_model(_cfg()), p=2, pp_rank=2)


def test_uniform_and_explicit_splits():
    from threefold.schedules.balance import split_counts, uniform_counts

    assert uniform_counts(8, 4) == (2, 2, 2, 2)
    assert uniform_counts(10, 4) == (2, 3, 3, 2)  # the remainder to the middle, not the ends
    assert uniform_counts(7, 3) == (2, 3, 2)
    assert split_counts("1,3", [1.0] * 4, 2) == (1, 3)
    for bad in ("1,2", "0,4", "1,1,2", "2,x"):
        with pytest.raises(ConfigError, match="parallel.pipeline_split.*adding up to the "
                                              "model's 4 layers, e.g. '2,2'"):
            split_counts(bad, [1.0] * 4, 2)
    for bad in ("balanced", "x,y"):
        with pytest.raises(ConfigError, match="not params, flops, uniform"):
            split_counts(bad, [1.0] * 4, 2)
    model = _model(_cfg(layers=4))
    assert [list(c.model.layers.layer_ids) for i in range(2)
            for c in split_model(model, 2, 1, i, balance="1,3")] == [[0], [1, 2, 3]]
    assert [list(c.model.layers.layer_ids) for c in split_model(model, 2, 2, 1,
                                                                balance="uniform")] == [[1], [3]]


def test_tied_head_on_another_rank_is_a_copy_of_the_embedding():
    from threefold.parallel.pipeline.stage import embedding_replica

    cfg = _cfg(layers=4, tie_word_embeddings=True)
    model = _model(cfg)
    first, = split_model(model, p=2, pp_rank=0)
    last, = split_model(model, p=2, pp_rank=1)
    assert embedding_replica(first) is None and embedding_replica(last) is last.lm_head.weight
    assert last.lm_head.weight is not model.model.embed_tokens.weight  # its own storage
    assert torch.equal(last.lm_head.weight, model.model.embed_tokens.weight)
    # built alone and initialised by name, the copy starts from the embedding's values
    alone = _materialise(split_model(CausalLM(cfg), p=2, pp_rank=1))[0]
    assert torch.equal(alone.lm_head.weight, model.model.embed_tokens.weight)
    # all stages on one rank (p = 1, v = 2): the head stays the embedding itself
    chunks = split_model(model, p=1, v=2)
    assert chunks[-1].lm_head.weight is chunks[0].model.embed_tokens.weight
    assert embedding_replica(rank_model(chunks)) is None


def test_chunks_keep_names_own_the_ends_and_compose_to_the_model():
    cfg, p, v = _cfg(), 2, 2
    whole = _model(cfg)
    ids, _ = _batch(0)
    names = []
    per_rank = []
    for r in range(p):  # allocated and initialised chunk by chunk, or as one rank module
        chunks = split_model(_model(cfg), p, v, r)
        _materialise(chunks if r == 0 else [rank_model(chunks)])
        per_rank.append(chunks)
    for r, chunks in enumerate(per_rank):
        for c, chunk in enumerate(chunks):
            s = c * p + r  # Megatron's interleaved assignment
            assert chunk.pipeline_stage == s and len(chunk.model.layers) == 2
            assert (chunk.model.embed_tokens is not None) == (s == 0)
            assert (chunk.lm_head is not None) == (chunk.model.norm is not None) == (s == 3)
        names += [n for n, _ in rank_model(chunks).named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())  # disjoint, complete
    full = dict(whole.named_parameters())
    for chunks in per_rank:  # initialised alone, by name, equal to the whole model
        for n, q in rank_model(chunks).named_parameters():
            assert torch.equal(q, full[n]), n
    x = ids
    for s in range(p * v):  # the chunks run in stage order are the model
        x = per_rank[s % p][s // p](x)
    assert torch.equal(x, whole(ids))


# --------------------------------------------------------------------------------------------
# Split backward and the single-rank executor
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["fp32", "bf16_autocast", "checkpointed", "selective",
                                     "selective_modules"])
def test_split_backward_equals_one_backward(variant):
    """B (input grad) then W (weight grads) gives exactly what one backward gives, on a middle
    stage whose input requires grad and on the last stage (loss); under selective recompute
    (with named modules too: train.recompute_modules) W recomputes the blocks again."""
    from threefold.parallel.transforms.recompute import apply_recompute

    cfg = _cfg(layers=4)
    chunk = split_model(_model(cfg), 2, 1, 1)[0]  # layers 2-3, norm, head
    if variant in ("checkpointed", "selective"):
        apply_recompute(chunk, "full" if variant == "checkpointed" else variant)
    if variant == "selective_modules":
        apply_recompute(chunk, "selective", ("core_attn", "mlp"))
    _, labels = _batch(0)
    x0 = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if variant == "bf16_autocast"
           else torch.autocast("cpu", enabled=False))

    def forward():
        x = x0.clone().requires_grad_(True)
        with ctx:
            return x, chunk(x, labels=labels).sum()

    x, loss = forward()
    loss.backward()
    want = {n: q.grad.clone() for n, q in chunk.named_parameters()}
    want_x = x.grad.clone()
    chunk.zero_grad(set_to_none=True)
    x, loss = forward()
    split = SplitBackward(loss, None, x, set(chunk.parameters()))
    assert all(q.grad is None for q in chunk.parameters())  # B touched no weight
    assert len(split.joins) == len(want) and not split.fallback  # every weight split off
    assert torch.equal(split.input_grad, want_x)
    split.weight_backward()
    for n, q in chunk.named_parameters():
        assert torch.equal(q.grad, want[n]), n


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)])
def test_one_rank_pipeline_is_gradient_accumulation(schedule, v):
    """pp = 1 (interleaved: two chunks on one rank, handed over in memory) gives the
    gradient of the whole batch."""
    cfg = _cfg(layers=4)
    ids, labels = _batch(1)
    n = int((labels != -100).sum())
    ref = _model(cfg)
    (causal_lm_loss(ref(ids), labels) / n).backward()
    chunks = split_model(_model(cfg), 1, v, 0)
    mbs = [(ids[i:i + 2], labels[i:i + 2]) for i in range(0, BATCH, 2)]
    records = []
    loss = pipeline_step(chunks, schedule, 1, 4, v, 0, None, mbs, n,
                         records=records)
    with torch.no_grad():
        want = (causal_lm_loss(ref(ids), labels) / n).item()
    assert loss == pytest.approx(want, rel=1e-6)
    got = dict(rank_model(chunks).named_parameters())
    for name, q in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert len([r for r in records if r.category == "compute"]) == \
        sum(a.kind.is_compute for a in build_schedule(schedule, 1, 4, v)[0])
    grads = {k: q.grad.clone() for k, q in got.items()}
    ex = PipelineExecutor(chunks, schedule, 1, 4, v, 0, None)
    assert ex.evaluate(mbs) == pytest.approx(want * n, rel=1e-6)  # forward only: token sum
    assert all(torch.equal(q.grad, grads[k]) for k, q in got.items())  # no gradient touched


def test_dict_microbatches_carry_packed_documents():
    """train.py's micro-batch dicts: document ids and restarting positions reach every chunk
    (here two chunks on one rank), so packed sequences keep attention inside documents."""
    from threefold.model.attention import document_position_ids

    cfg = _cfg(layers=4)
    ids, labels = _batch(2)
    docs = (torch.arange(SEQ) >= SEQ // 3).long().expand(BATCH, SEQ)  # two documents a row
    pos = document_position_ids(docs)
    n = int((labels != -100).sum())
    ref = _model(cfg)
    with torch.no_grad():
        want = causal_lm_loss(ref(ids, position_ids=pos, document_ids=docs), labels).item()
        plain = causal_lm_loss(ref(ids), labels).item()
    assert abs(want - plain) > 1e-5 * abs(want)  # the documents change the loss (> rel 1e-6)
    chunks = split_model(_model(cfg), 1, 2, 0)
    mbs = [{"input_ids": ids[i:i + 4], "labels": labels[i:i + 4], "position_ids": pos[i:i + 4],
            "document_ids": docs[i:i + 4]} for i in (0, 4)]
    ex = PipelineExecutor(chunks, "interleaved-1f1b", 1, 2, 2, 0, None)
    assert ex.evaluate(mbs) == pytest.approx(want, rel=1e-6)
    assert ex.run(mbs, n) == pytest.approx(want / n, rel=1e-6)


def test_executor_refuses_mismatched_chunks_and_microbatches():
    chunks = split_model(_model(_cfg(layers=4)), 1, 2, 0)
    with pytest.raises(ValueError, match="1 chunk"):
        PipelineExecutor(chunks, "1f1b", 1, 4, 1, 0, None)
    with pytest.raises(ValueError, match="multiple of pp"):
        PipelineExecutor(chunks, "interleaved-1f1b", 3, 4, 2, 0, None)
    ex = PipelineExecutor(chunks, "interleaved-1f1b", 1, 4, 2, 0, None)
    with pytest.raises(ValueError, match="4 microbatches, got 2"):
        ex.run([_batch(0)] * 2, 100)


# --------------------------------------------------------------------------------------------
# Every schedule on several ranks equals one process
# --------------------------------------------------------------------------------------------
def _train_single(cfg: ModelConfig):
    from threefold.parallel.engines.engine import LocalEngine

    model = _model(cfg)
    engine = LocalEngine(model, _optim())
    losses = []
    for step in range(STEPS):
        ids, labels = _batch(step)
        loss = causal_lm_loss(model(ids), labels) / int((labels != -100).sum())
        loss.backward()
        engine.step(LR)
        losses.append(loss.item())
    with torch.no_grad():  # evaluation: the summed token loss of a fresh batch
        ids, labels = _batch(STEPS)
        losses.append(causal_lm_loss(model(ids), labels).item())
    return losses, {n: q.detach().clone() for n, q in model.named_parameters()}


def _train_pipeline(rank, world, name, schedule, p, m, v=1, zero=0, ac=False, inflight=0):
    """One layout on this rank: pp = p, the rest data parallel (dp_shard), engine by ``zero``
    (0: plain AdamW or bucketed all-reduce; 1-3: ZeRO), blocks recomputed in backward with
    ``ac``. Returns losses, this rank's final
    whole weights (dp rank 0 only) and the last step's measured trace."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.parallel.engines.data_parallel import DataParallelEngine
    from threefold.parallel.engines.engine import LocalEngine
    from threefold.parallel.engines.zero import ZeroEngine

    dims = Layout(dp_shard=world // p, tp=1, pp=p)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    pp_rank, dp_rank, dp = comm.rank("pp"), comm.rank("dp"), comm.size("dp")
    chunks = split_model(_model(_cfg()), p, v, pp_rank, vshape=schedule_spec(schedule).vshape)
    model = rank_model(chunks)
    if ac:
        from threefold.parallel.transforms.recompute import apply_recompute

        apply_recompute(model, "full" if ac is True else ac)
    if zero:
        units = [u for u in (model.model.embed_tokens, *model.model.layers, model.model.norm,
                             model.lm_head) if u is not None]
        engine = ZeroEngine(model, units, _optim(), comm, zero)
    elif dp > 1:
        engine = DataParallelEngine(model, _optim(), comm, bucket_mb=0.05)
    else:
        engine = LocalEngine(model, _optim(), comm)
    ex = PipelineExecutor(chunks, schedule, p, m, v, pp_rank, comm,
                          grad_sync=engine.micro_step, inflight=inflight)
    losses = []
    for step in range(STEPS + 1):  # the last one only evaluates
        ids, labels = _batch(step)
        n_tokens = int((labels != -100).sum())  # the global batch's, known to every rank
        rows = BATCH // dp
        ids, labels = ids[dp_rank * rows:(dp_rank + 1) * rows], \
            labels[dp_rank * rows:(dp_rank + 1) * rows]
        mb = rows // m
        micro = [(ids[i:i + mb], labels[i:i + mb]) for i in range(0, rows, mb)]
        if step == STEPS:
            records = ex.records  # the last training step's
            total = torch.tensor([ex.evaluate(micro)], dtype=torch.float64)
        else:
            total = torch.tensor([ex.run(micro, n_tokens)], dtype=torch.float64)
            engine.finish_gradients()
            engine.step(LR)
        comm.all_reduce(total, "dp")
        losses.append(float(total))
    weights = engine.state_dict()["model"]  # collective under ZeRO
    n_compute = sum(a.kind.is_compute for a in ex.actions)
    return {"losses": losses, "weights": weights if dp_rank == 0 else {},
            "records": records, "n_compute": n_compute}


def _runs(rank, world, runs):
    return {run["name"]: _train_pipeline(rank, world, **run) for run in runs}


RUNS_2 = [
    dict(name="gpipe", schedule="gpipe", p=2, m=4),
    dict(name="1f1b", schedule="1f1b", p=2, m=4),
    dict(name="interleaved", schedule="interleaved-1f1b", p=2, m=4, v=2),
    dict(name="zb-h1", schedule="zb-h1", p=2, m=4),
    dict(name="zb-v", schedule="zb-v", p=2, m=4, v=2),
    dict(name="dualpipe-v", schedule="dualpipe-v", p=2, m=4, v=2),
    dict(name="interleaved_inflight3", schedule="interleaved-1f1b", p=2, m=4, v=2, inflight=3),
]
RUNS_4 = [
    dict(name="gpipe", schedule="gpipe", p=4, m=4),
    dict(name="1f1b", schedule="1f1b", p=4, m=8),
    dict(name="interleaved", schedule="interleaved-1f1b", p=4, m=8, v=2),
    dict(name="zb-h1", schedule="zb-h1", p=4, m=8),
    dict(name="zb-v", schedule="zb-v", p=4, m=8, v=2),
    dict(name="dualpipe-v", schedule="dualpipe-v", p=4, m=8, v=2),
    dict(name="interleaved_inflight6", schedule="interleaved-1f1b", p=4, m=8, v=2, inflight=6),
    dict(name="pp2_dp2_1f1b", schedule="1f1b", p=2, m=2),
    dict(name="pp2_zero3_zb-v", schedule="zb-v", p=2, m=4, v=2, zero=3),
    dict(name="pp2_zero1_dualpipe-v_ac", schedule="dualpipe-v", p=2, m=4, v=2, zero=1, ac=True),
    dict(name="pp2_zero1_interleaved", schedule="interleaved-1f1b", p=2, m=2, v=2, zero=1),
    dict(name="pp2_zero3_zb-h1", schedule="zb-h1", p=2, m=4, zero=3),
    # W recomputes a checkpointed block after ZeRO-3 released it (found by the layout fuzzer)
    dict(name="pp2_zero3_zb-h1_ac", schedule="zb-h1", p=2, m=4, zero=3, ac=True),
    dict(name="pp2_zero3_zb-h1_selective", schedule="zb-h1", p=2, m=4, zero=3, ac="selective"),
]


@pytest.fixture(scope="module")
def single():
    """One process, whole batch: the losses (and evaluation loss) and weights to match."""
    return _train_single(_cfg())


@pytest.mark.slow
@pytest.mark.parametrize("world,runs", [(2, RUNS_2), (4, RUNS_4)], ids=["2ranks", "4ranks"])
def test_every_schedule_equals_single_process(world, runs, single, tmp_path):
    ref_losses, ref_weights = single
    results = run_distributed(_runs, world, runs, timeout=300)
    for run in runs:
        name = run["name"]
        per_rank = [r[name] for r in results]
        for r in per_rank:  # training losses, then the evaluation loss of the final weights
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        weights = {}
        for r in per_rank:
            assert not set(weights) & set(r["weights"]), name  # each weight on one stage
            weights.update(r["weights"])
        assert set(weights) == set(ref_weights), name
        for k, want in ref_weights.items():
            torch.testing.assert_close(weights[k], want, rtol=1e-4, atol=2e-5,
                                       msg=f"{name}: {k}")
        # the measured trace: one record per compute action, in the schedule's order
        for rank, r in enumerate(per_rank):
            compute = [x for x in r["records"] if x.category == "compute"]
            assert len(compute) == r["n_compute"], name
            assert all(x.end_s >= x.start_s for x in r["records"])
        records = [x for r in per_rank for x in r["records"]]
        assert 0.0 <= idle_fraction(records) < 1.0
    path = tmp_path / "trace.json"
    write_chrome_trace([x for r in results for x in r[runs[-1]["name"]]["records"]], path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(r[runs[-1]["name"]]["records"]) for r in results)


def test_flops_balance_counts_the_routed_experts():
    """A mixture of experts' FLOPs balance counts the router and the k experts a token is
    routed to (3-D tensors, not nn.Linear layers): the costs sum to the PaLM count the cost
    model uses, block by block they equal the planner's, and a DeepSeek-shaped model's dense
    first blocks (as wide as k routed experts and the shared one) cost what its MoE blocks do
    rather than about twice as much."""
    from threefold.accounting import flops_per_token, pipeline_layers
    from threefold.accounting.stages import _block_flops, shape_key
    from threefold.layout import Layout

    cfg = ModelConfig(preset="deepseek-v3", vocab_size=VOCAB, num_hidden_layers=8,
                      hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, num_local_experts=8, num_experts_per_tok=4,
                      intermediate_size=32, shared_expert_intermediate_size=32,
                      dense_intermediate_size=160, n_group=4, topk_group=2,
                      first_k_dense_replace=2).resolved()
    with torch.device("meta"):
        model = CausalLM(cfg)
    layers, first, last = stage_costs(model, "flops", seq_len=SEQ)
    assert sum(layers) + first + last == flops_per_token(cfg, SEQ)
    assert layers == [_block_flops(shape_key(cfg), i, SEQ) for i in range(8)]
    # dense 3·64·160 against router 8·64 + 4 experts and the shared one 5·3·64·32
    assert layers[0] == pytest.approx(layers[2], rel=0.05)
    lay = Layout(pp=4, pipeline_split=f"flops:{SEQ}")
    assert pipeline_layers(cfg, lay) == tuple(len(r) for r in partition(layers, 4, first, last))
