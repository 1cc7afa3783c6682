"""`threefold train --dry-run` and the planner against the runtime: a 70B layout checked on the
meta device without allocating it; bad layouts refused; the activation count against
autograd's saved tensors; the planner's bytes per axis against what real runs report."""

from __future__ import annotations

import contextlib
import resource
import time

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.dist import run_distributed
from tests.test_tp_layer import SavedBytes
from threefold.layout import Layout, Workload
from threefold.accounting import (comm_bytes_per_step, layer_parameters_per_rank, num_parameters,
    parameter_numels, stage_parameters, stage_units, tp_shard)
from threefold.commands.main import main as cli_main
from threefold.config import ConfigError, ModelConfig, load_config
from threefold.model.decoder import CausalLM
from threefold.plan.activations import block_activation_bytes, model_layer_activation_bytes
from threefold.launch.dryrun import _MetaComm, dry_run, meta_parameter_counts, predict

LLAMA70B = [("model.preset", "llama3-70b"), ("data.seq_len", "4096"),
            ("train.global_batch_size", "8"), ("train.micro_batch_size", "1"),
            ("train.dtype", "bfloat16"), ("parallel.tp", "8"), ("parallel.zero_stage", "3"),
            ("parallel.sequence_parallel", "true"), ("train.activation_checkpointing", "true")]


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(scope="module")
def warm():
    """Pay once for what torch imports the first time the meta device is used (seconds, not
    related to the model's size), so the 70B check times the dry run itself."""
    with torch.device("meta"):
        CausalLM(ModelConfig(preset="tiny", vocab_size=256).resolved())


def test_llama70b_on_64_ranks_without_allocating(warm, monkeypatch):
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, LLAMA70B)
    lines: list[str] = []
    before, t0 = _rss(), time.perf_counter()
    assert dry_run(cfg, 64, out=lines.append) == 0
    elapsed, grown = time.perf_counter() - t0, _rss() - before
    assert elapsed < 10, f"dry run took {elapsed:.1f} s"
    assert grown < 1e9, f"RSS grew {grown / 1e9:.2f} GB"  # 70B fp32 would be 282 GB
    text = lines[0]
    assert "70.55B parameters" in text and "nothing allocated" in text
    assert "dp_shard 8 × tp 8" in text and "zero 3" in text and "64 × h100" in text
    r = predict(cfg, 64)
    assert r.total_parameters == num_parameters(r.model) == 70_553_706_496
    assert r.parameters_per_rank == stage_parameters(r.model, r.layout, 0)
    assert r.owned_per_rank == pytest.approx(r.parameters_per_rank / 8, rel=1e-6)
    assert r.memory.total < 80e9 and "fits" in text  # one microbatch, full recompute
    assert r.step is not None and 0 < r.step.mfu < 1 and r.comm_bytes["tp"] > 0
    assert f"tp {r.comm_bytes['tp']:,}" in text and f"dp_shard {r.comm_bytes['dp_shard']:,}" \
        in text


def test_pipelined_dry_run_reports_rank_0_after_the_split(warm, monkeypatch):
    """With pp the dry run counts rank 0's chunk on the meta device (checked against the
    planner inside ``predict``) and lists the blocks and parameters of every stage."""
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, [("model.preset", "llama3-8b"), ("parallel.pp", "4"),
                             ("parallel.zero_stage", "1"), ("train.micro_batch_size", "1"),
                             ("train.global_batch_size", "64"), ("data.seq_len", "1024")])
    lines: list[str] = []
    assert dry_run(cfg, 32, out=lines.append) == 0
    r = predict(cfg, 32)
    assert r.parameters_per_rank == stage_parameters(r.model, r.layout, 0) < 2.1e9  # not 8B
    assert r.owned_per_rank == sum(-(-sum(u) // 8) for u in stage_units(r.model, r.layout, 0))
    assert "pipeline blocks per virtual stage: 7, 9, 9, 7" in lines[0]
    assert "parameters per rank (rank 0): 2.05B held" in lines[0]


def test_cli_dry_run_prints_and_exits_0(warm, monkeypatch, capsys):
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    argv = ["train", "--dry-run", "--nproc-per-node", "64"]
    for k, v in LLAMA70B:
        argv += [f"--{k}", v]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "tokens/s" in out and "MFU" in out


def test_dry_run_with_optimizer_offload_reports_host_memory(warm, monkeypatch):
    """``parallel.offload_optimizer``: the device figure loses the optimiser state, the host
    line shows 16 bytes per owned parameter (fp32 master, moments, gradient buffer) per rank
    and per node, and the PCIe bytes per step (fp32 gradients down, parameters up)."""
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    base = [("model.preset", "llama3-8b"), ("parallel.zero_stage", "3"),
            ("train.micro_batch_size", "1"), ("train.global_batch_size", "8"),
            ("data.seq_len", "1024"), ("train.dtype", "bfloat16")]
    on = predict(load_config(None, base), 8)
    cfg = load_config(None, base + [("parallel.offload_optimizer", "true")])
    lines: list[str] = []
    assert dry_run(cfg, 8, out=lines.append) == 0
    r = predict(cfg, 8)
    owned = r.owned_per_rank
    assert r.memory.host == 16 * owned and on.memory.host == 0
    # bf16 compute under ZeRO-3 holds bf16 parameters (parallel.param_dtype auto): the
    # optimiser's state is the fp32 master shard and the moments, 12 bytes per owned one
    assert r.memory.optimizer == 0 and on.memory.optimizer == 12 * owned
    assert on.memory.total - r.memory.total >= 8 * owned
    assert r.offload_bytes == {"down": 4 * owned, "up": 4 * owned}
    text = lines[0]
    assert "with the optimizer offloaded to the host" in text
    assert "host memory per rank (optimizer offload)" in text
    assert f"gradients down {4 * owned:,} bytes" in text and "for the 8 rank(s) of a node" in text
    assert r.step.offload_s == pytest.approx(8 * owned / 64e9)


def test_dry_run_says_zero_bubble_recomputes_per_weight_under_checkpointing(warm):
    """zb-h1's W passes under activation checkpointing recompute a block per split weight
    (one autograd call each): the dry run says so; 1f1b with recompute gets no such note."""
    def notes(schedule):
        cfg = load_config(None, [("parallel.pp", "2"), ("parallel.schedule", schedule),
                                 ("train.activation_checkpointing", "true"),
                                 ("train.micro_batch_size", "2")])
        return " ".join(predict(cfg, 2).notes)

    assert "zb-h1 with activation checkpointing" in notes("zb-h1")
    assert "zb-h1" not in notes("1f1b")


def test_dry_run_on_this_cpu_measures_it(warm, monkeypatch):
    monkeypatch.delenv("THREEFOLD_HARDWARE", raising=False)
    cfg = load_config(None, [("train.device", "cpu"), ("data.seq_len", "128")])
    lines: list[str] = []
    assert dry_run(cfg, 2, out=lines.append) == 0
    assert "this CPU" in lines[0] and "GFLOP/s measured" in lines[0]
    r = predict(cfg, 2)
    assert r.cluster.hardware.peak_flops("fp32") > 1e8 and r.memory.overhead == 0
    assert r.comm_bytes["dp"] == comm_bytes_per_step(r.model, r.layout, r.work)["dp"] > 0


@pytest.mark.parametrize("overrides,world,match", [
    ([("parallel.tp", "3")], 6, "num_attention_heads"),  # 8 heads
    ([("train.global_batch_size", "9"), ("train.micro_batch_size", "1")], 2, "global_batch"),
    ([("parallel.tp", "2"), ("parallel.sequence_parallel", "true"), ("data.seq_len", "255")],
     2, "seq_len"),
    ([("parallel.dp_shard", "3")], 2, "dp_shard"),
    ([("model.vocab_size", "100")], 1, "vocab_size"),
])
def test_bad_layouts_raise_config_error(warm, monkeypatch, overrides, world, match):
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=match):
        dry_run(cfg, world, out=lambda s: None)


def test_more_pipeline_stages_than_layers_is_refused(warm, monkeypatch):
    """The dry run refuses it, and so does the planner's check of its Layout, with the rule
    book's one message."""
    from threefold.layout import check_layout
    from threefold.layout.rules import LayoutError

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, [("parallel.pp", "5")])  # 4 layers
    said = "4 layers cannot fill pp·vpp = 5·1 = 5 pipeline chunks"
    with pytest.raises(LayoutError, match=said):
        dry_run(cfg, 5, out=lambda s: None)
    with pytest.raises(LayoutError, match=said):
        check_layout(ModelConfig(preset="tiny", vocab_size=320).resolved(), Layout(pp=5),
                     Workload(seq_len=64, global_batch=8))


# --------------------------------------------------------------------------------------------
# The counts the planner makes, against the model itself
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,tied", [(1, False), (2, False), (8, False), (1, True), (4, True)])
def test_meta_model_matches_planner_parameter_order(warm, tp, tied):
    """Per-rank parameter sizes in registration order (the order gradient buckets are cut
    in) equal the meta model's after tensor parallelism; tp 8 replicates the 4 kv heads."""
    from threefold.parallel.transforms.tensor import apply_tensor_parallel

    cfg = ModelConfig(preset="tiny", vocab_size=1001, tie_word_embeddings=tied).resolved()
    with torch.device("meta"):
        model = CausalLM(cfg)
    if tp > 1:
        apply_tensor_parallel(model, _MetaComm(tp), sequence_parallel=True)
    sizes = [p.numel() for p in model.parameters()]
    assert sizes == parameter_numels(cfg, Layout(tp=tp))
    assert meta_parameter_counts(cfg, tp, True) == (num_parameters(cfg), sum(sizes), 0)


@pytest.mark.parametrize("preset,pp,vpp,tied,split", [
    ("llama3-8b", 4, 1, False, "params"), ("llama3-8b", 8, 1, False, "params"),
    ("llama3-8b", 2, 2, False, "params"), ("small", 3, 1, False, "params"),
    ("tiny", 2, 1, True, "params"), ("tiny", 2, 2, True, "params"),
    ("llama3-8b", 4, 1, False, "uniform"), ("llama3-8b", 3, 1, False, "uniform"),
    ("llama3-8b", 4, 1, False, "6,10,10,6"), ("llama3-8b", 4, 1, False, "flops"),
    ("tiny", 4, 1, False, "flops")])
def test_planner_splits_the_pipeline_as_the_runtime_does(warm, preset, pp, vpp, tied, split):
    """Blocks and parameters per pipeline rank in the planner (``pipeline_layers``,
    ``stage_parameters``) equal those of ``split_model``'s chunks on the meta device, uneven
    splits included (llama3-8b at pp 4: 7, 9, 9, 7; a tied head's copy on the last rank), and
    with ``parallel.pipeline_split`` uniform or given."""
    from threefold.accounting import pipeline_layers
    from threefold.parallel.pipeline.stage import rank_model, split_model

    vocab = None if preset == "llama3-8b" else 4096  # the preset's 128,256, or 4096
    cfg = ModelConfig(preset=preset, vocab_size=vocab, tie_word_embeddings=tied).resolved()
    seq = 2048  # the flops balance weighs attention at this length
    lay = Layout(pp=pp, vpp=vpp, schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
                 pipeline_split=f"flops:{seq}" if split == "flops" else split)
    with torch.device("meta"):
        model = CausalLM(cfg)
    blocks = []
    for rank in range(pp):
        chunks = split_model(model, pp, vpp, rank, balance=split, seq_len=seq)
        blocks.append([len(c.model.layers) for c in chunks])
        held = sum(q.numel() for q in rank_model(chunks).parameters())
        assert held == stage_parameters(cfg, lay, rank), (rank, blocks)
    counts = pipeline_layers(cfg, lay)  # virtual stage c·pp + rank is chunk c of rank
    assert [[counts[c * pp + r] for c in range(vpp)] for r in range(pp)] == blocks
    if (preset, pp, split) == ("llama3-8b", 4, "params"):
        assert counts == (7, 9, 9, 7)
    if (preset, pp, split) == ("llama3-8b", 3, "uniform"):
        assert counts == (10, 11, 11)
    if (preset, pp, split) == ("llama3-8b", 4, "flops"):
        assert counts == (8, 9, 9, 6)  # the head costs ~2.4 blocks of FLOPs, the embedding 0


class _Loopback(_MetaComm):
    """``tp`` identical tp ranks: each collective returns what it would if every rank held
    this rank's tensor, so one process runs a sharded block with the real autograd graph."""

    def all_reduce(self, x, axis, op="sum", async_op=False):
        if op == "sum":
            x.mul_(self.tp)

    def all_gather(self, out, x, axis, async_op=False):
        out.copy_(x.reshape(-1).repeat(self.tp).view_as(out))

    def reduce_scatter(self, out, x, axis, op="sum", async_op=False):
        out.copy_(x.reshape(self.tp, -1)[0].view_as(out) * self.tp)


@pytest.mark.parametrize("tp,sp,qwen", [(1, False, ""), (2, False, ""), (2, True, ""),
                                         (8, True, ""), (1, False, "qwen3"),
                                         (2, True, "qwen3"), (2, True, "qwen2")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_activation_bytes_equal_autograd_saved_tensors(tp, sp, qwen, dtype):
    """Every byte autograd saves in one block (distinct storages, weights excluded) is what
    ``block_activation_bytes`` counts, plus the RoPE tables (fp32) or the autocast weight
    copies (bf16). Under SP the sub-layer inputs are kept gathered, at full size. Qwen3's
    q/k norms (with a head width of its own) add ``qk_norm_bytes``; Qwen2's biases nothing."""
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.activations import qk_norm_bytes

    extra = {"qwen3": {"qk_norm": True, "attention_head_dim": 24},
             "qwen2": {"qkv_bias": True}}.get(qwen, {})
    cfg = ModelConfig(preset="tiny", vocab_size=512, **extra).resolved()
    model = CausalLM(cfg)
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    b, s, h = 2, 64, cfg.hidden_size
    x = torch.randn(b, s // tp if sp else s, h, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    with SavedBytes(list(model.parameters())) as saved, auto:
        model.model.layers[0](x, cos, sin)
    d = 2 if dtype == torch.bfloat16 else 4
    sh = tp_shard(cfg, tp)
    want = block_activation_bytes(b * s, h, sh.heads, sh.kv_heads, cfg.head_dim, sh.ffn, tp,
                                  sp, act_bytes=d, residual_bytes=4)
    want += 2 * 4 * b * s * cfg.head_dim if d == 4 else d * layer_parameters_per_rank(cfg, tp)[0]
    if cfg.qk_norm:
        want += qk_norm_bytes(b * s, sh.heads, sh.kv_heads, cfg.head_dim, d)
    assert saved.total == want
    lay = Layout(tp=tp, sequence_parallel=sp, microbatch_size=b)  # the planner's figure
    work = Workload(s, b, precision="bf16" if d == 2 else "fp32", residual_bytes=4)
    assert model_layer_activation_bytes(cfg, lay, work) == want - (
        2 * 4 * b * s * cfg.head_dim if d == 4 else d * layer_parameters_per_rank(cfg, tp)[0])


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_document_mask_bytes_equal_what_masked_attention_adds(tp, sp, dtype):
    """With packed documents (``data.document_mask``) a block saves, beyond the unmasked
    count, exactly ``document_mask_bytes``: K/V repeated to the query heads and the mask as
    the kernel converts it; the Workload of such a config says so."""
    from threefold.model.attention import document_mask
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.activations import document_mask_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512).resolved()
    model = CausalLM(cfg)
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    b, s = 2, 64
    saved = {}
    for masked in (False, True):
        x = torch.randn(b, s // tp if sp else s, cfg.hidden_size, requires_grad=True)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        mask = document_mask((torch.arange(s) // 10).expand(b, s)) if masked else None
        auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
            contextlib.nullcontext()
        with SavedBytes(list(model.parameters()) + ([mask] if masked else [])) as held, auto:
            model.model.layers[0](x, cos, sin, mask)
        saved[masked] = held.total
    sh = tp_shard(cfg, tp)
    d = 2 if dtype == torch.bfloat16 else 4
    assert saved[True] - saved[False] == document_mask_bytes(b * s, sh.heads, sh.kv_heads,
                                                             cfg.head_dim, s, d) > 0
    from threefold.layout import Workload
    work = Workload.from_config(load_config(None, [("data.document_mask", "true")]))
    assert work.document_mask


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_block_bytes_equal_what_the_block_holds(tp, sp, dtype):
    """Under selective recompute a block holds ``selective_block_bytes`` less its input
    (made outside): the matmuls' and the attention's outputs, nothing of the norms, RoPE,
    SwiGLU's product or the casts. Measured at two lengths, so that what does not grow with
    the tokens (the profiler's and the checkpoint's own) drops out; the block's gradients
    equal those without recompute."""
    from bench.bench_kernels import held_after_forward
    from threefold.parallel.transforms.recompute import apply_recompute
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.selective import selective_block_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512, num_hidden_layers=1).resolved()
    torch.manual_seed(0)
    model = CausalLM(cfg)
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    block, b, h = model.model.layers[0], 2, cfg.hidden_size
    d = 2 if dtype == torch.bfloat16 else 4
    sh = tp_shard(cfg, tp)
    held, grads = {}, {}
    for mode in ("none", "selective"):
        apply_recompute(model, mode)
        for s in (64, 128):
            x = torch.randn(b, s // tp if sp else s, h, requires_grad=True,
                            generator=torch.Generator().manual_seed(s))
            cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
            held[mode, s] = held_after_forward(block, x, cos, sin, dtype)
            auto = torch.autocast("cpu", dtype=dtype) if d == 2 else contextlib.nullcontext()
            with auto:
                y = block(x, cos, sin)
            grads[mode, s] = torch.autograd.grad(y.float().pow(2).sum(),
                                                 [x, *block.parameters()])
    want = [selective_block_bytes(b * s, h, sh.heads, sh.kv_heads, cfg.head_dim, sh.ffn, tp,
                                  sp, act_bytes=d, residual_bytes=4)
            - 4 * b * s * h // (tp if sp else 1) for s in (64, 128)]  # less the input
    assert held["selective", 128] - held["selective", 64] == want[1] - want[0]
    assert held["selective", 64] < held["none", 64]
    for s in (64, 128):
        for a, c in zip(grads["none", s], grads["selective", s]):
            assert torch.equal(a, c)



def _held_over_microbatches(block, xs, cos, sin) -> int:
    """Bytes the forwards of ``xs`` through ``block`` leave allocated, less their outputs, each
    forward in an autocast context of its own as the trainer and the pipeline run them (one
    per microbatch), from the profiler's net allocations of the outermost ops."""
    from torch.profiler import ProfilerActivity, profile

    outs = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(block(x, cos, sin))
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    return held - sum(o.nbytes for o in outs)


def test_recomputed_blocks_keep_no_weight_casts_per_microbatch(monkeypatch):
    """Under bf16 autocast over fp32 weights, a microbatch's forward keeps its own casts of the
    weights without recompute, and none under full recompute (the checkpoint keeps the block's
    input; autocast's cache goes when the microbatch's context exits): only the block being
    recomputed holds its casts again. Measured on the tiny dense and MoE blocks over three
    microbatches; the planner holds one block's casts whatever the microbatches in flight.
    Llama 3 405B at tp 8 + SP, pp 16, ZeRO-1, full recompute (stage 1: 15 microbatches in
    flight) was once planned at 132.7 GB, 15 × 8 blocks' casts (95.6 GB) among them."""
    from threefold.parallel.transforms.recompute import apply_recompute
    from threefold.plan.memory import cast_weight_bytes, memory_per_rank, stage_memory

    b, s = 2, 64
    work = Workload(s, b, precision="bf16", residual_bytes=4, master_bytes=4)
    for moe in ({}, {"num_local_experts": 8, "num_experts_per_tok": 2}):
        cfg = ModelConfig(preset="tiny", vocab_size=512, num_hidden_layers=1, **moe).resolved()
        h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads
        attn = 2 * h * cfg.num_attention_heads * cfg.head_dim + 2 * h * kv * cfg.head_dim
        mlp = (8 * 3 * h * f + 8 * h) if moe else 3 * h * f  # experts and router, or SwiGLU
        block_casts = 2 * (attn + mlp)
        held = {}
        for mode in ("none", "full"):
            torch.manual_seed(0)
            model = CausalLM(cfg)
            apply_recompute(model, mode)
            xs = [torch.randn(b, s, h, requires_grad=True) for _ in range(3)]
            cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
            held[mode] = _held_over_microbatches(model.model.layers[0], xs, cos, sin)
        assert held["full"] < block_casts / 20 and held["none"] > 3 * block_casts, held
        if not moe:  # without recompute: each microbatch its activations and its own casts
            lay = Layout(microbatch_size=b)
            assert held["none"] == 3 * (model_layer_activation_bytes(cfg, lay, work)
                                        - 4 * b * s * h + cast_weight_bytes(cfg, lay, work, 0))
        deep = ModelConfig(preset="tiny", vocab_size=512, num_hidden_layers=4, **moe).resolved()
        four = Workload(s, 4, precision="bf16", residual_bytes=4, master_bytes=4)
        for mode in ("full", "selective"):  # stage 0: 2 blocks, 2 microbatches in flight
            lay = Layout(pp=2, microbatch_size=1, recompute=mode)
            got = memory_per_rank(deep, lay, four) if moe else stage_memory(deep, lay, four, 0)
            assert got.cast_weights == block_casts
        none = stage_memory(deep, Layout(pp=2, microbatch_size=1), four, 0)
        assert none.cast_weights == 2 * 2 * 2 * attn + (0 if moe else 2 * 2 * 2 * 3 * h * f)
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    r = predict(load_config(None, [
        ("model.preset", "llama3-405b"), ("data.seq_len", "8192"),
        ("train.global_batch_size", "2048"), ("train.micro_batch_size", "1"),
        ("train.dtype", "bfloat16"), ("parallel.tp", "8"), ("parallel.pp", "16"),
        ("parallel.zero_stage", "1"), ("parallel.sequence_parallel", "true"),
        ("train.recompute", "full")]), 16384)
    h, f = 16384, 53248  # a block's weights on one of 8 tp ranks, 2 bytes each
    assert r.memory.cast_weights == 2 * (2 * h * h + 2 * h * 1024 + 3 * h * f) // 8
    assert r.memory.total < 80e9  # 37.9 GB: Meta ran this family of layouts on 80 GB


def _cp_block_saved_bytes(rank, world, algorithm, dtype_name, kv_heads, window=0):
    """What autograd saves in one block of the tiny model on this cp rank (its share of 2
    sequences of 64 tokens), weights excluded, with the block's attention under
    ``algorithm``; run forward and backward on every rank (the ring needs all of them)."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.parallel.transforms.context import apply_context_parallel, shard_batch

    dims = Layout(cp=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    cfg = ModelConfig(preset="tiny", vocab_size=512, num_key_value_heads=kv_heads,
                      sliding_window=window).resolved()
    torch.manual_seed(0)
    model = apply_context_parallel(CausalLM(cfg), comm, algorithm,
                                   world if algorithm == "ulysses" else 1)
    b, s = 2, 64
    whole = torch.zeros(b, s, dtype=torch.long)
    micro = shard_batch({"input_ids": whole, "labels": whole}, world, comm.rank("cp"),
                        world if algorithm == "ulysses" else 1)
    cos, sin = model.model.rotary(micro["position_ids"])
    x = torch.randn(b, s // world, cfg.hidden_size, requires_grad=True)
    dtype = getattr(torch, dtype_name)
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    with SavedBytes(list(model.parameters())) as saved, auto:
        y = model.model.layers[0](x, cos, sin, model.model.attention_mask(None))
    y.float().sum().backward()
    return saved.total


@pytest.mark.slow
def test_block_activation_bytes_under_cp_equal_autograd_saved_tensors():
    """Under context parallelism (2 ranks, ring, allgather and Ulysses, fp32 and bf16
    autocast, with and without grouped-query attention) every byte autograd saves in one
    block is what
    ``block_activation_bytes(cp=2, ...)`` counts for the rank's tokens, plus the RoPE tables
    (fp32) or the autocast weight copies (bf16), as in the cp = 1 test above."""
    from tests.dist import run_checks

    cases = [(a, dt, kv) for a in ("ring", "allgather", "ulysses")
             for dt in ("float32", "bfloat16") for kv in (4, 8)]
    windowed = ("ulysses", "float32", 4, 16)  # Mistral's window under Ulysses: a masked SDPA
    results = run_checks(2, [(_cp_block_saved_bytes, c) for c in cases + [windowed]],
                         timeout=180)
    cfg = ModelConfig(preset="tiny", vocab_size=512, sliding_window=16).resolved()
    lay = Layout(cp=2, cp_algorithm="ulysses", microbatch_size=2)
    work = Workload(seq_len=64, global_batch=2, precision="fp32", residual_bytes=4)
    want = model_layer_activation_bytes(cfg, lay, work) + 2 * 4 * 2 * 64 // 2 * cfg.head_dim
    assert model_layer_activation_bytes(cfg, lay, work) > block_activation_bytes(
        2 * 64 // 2, cfg.hidden_size, 8, 4, cfg.head_dim, cfg.intermediate_size, act_bytes=4,
        residual_bytes=4, seq_len=64, cp=2, cp_algorithm="ulysses")  # the mask is counted
    assert results.pop() == [want] * 2
    b, s, cp = 2, 64, 2
    for (algorithm, dt, kv), per_rank in zip(cases, results):
        cfg = ModelConfig(preset="tiny", vocab_size=512, num_key_value_heads=kv).resolved()
        d = 2 if dt == "bfloat16" else 4
        want = block_activation_bytes(b * s // cp, cfg.hidden_size, cfg.num_attention_heads,
                                      kv, cfg.head_dim, cfg.intermediate_size, act_bytes=d,
                                      residual_bytes=4, seq_len=s, cp=cp,
                                      cp_algorithm=algorithm)
        want += 2 * 4 * b * s // cp * cfg.head_dim if d == 4 else \
            d * layer_parameters_per_rank(cfg, 1)[0]
        assert per_rank == [want] * cp, (algorithm, dt, kv)
    # the planner's per-layer figure is the same count

    cfg = ModelConfig(preset="tiny", vocab_size=512).resolved()
    work = Workload(seq_len=s, global_batch=b, precision="fp32", residual_bytes=4)
    for algorithm in ("ring", "allgather"):
        lay = Layout(cp=cp, cp_algorithm=algorithm, microbatch_size=b)
        assert model_layer_activation_bytes(cfg, lay, work) == block_activation_bytes(
            b * s // cp, cfg.hidden_size, 8, 4, cfg.head_dim, cfg.intermediate_size,
            act_bytes=4, residual_bytes=4, seq_len=s, cp=cp, cp_algorithm=algorithm)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, True)])
def test_head_saved_bytes_equal_autograd_saved_tensors(tp, sp):
    """What the final norm, the head and the (vocab-parallel) chunked loss keep for backward,
    per microbatch, is ``head_saved_bytes``: fp32, with and without tp and SP."""
    from threefold.parallel.transforms.tensor import apply_tensor_parallel
    from threefold.plan.activations import head_saved_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=500, num_hidden_layers=1).resolved()
    model = CausalLM(cfg)
    model.model.layers = torch.nn.ModuleList()  # only the norm, the head and the loss
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    model.lm_head.chunk = 5  # several chunks: what is kept does not depend on them
    b, s, h = 2, 16, cfg.hidden_size
    x = torch.randn(b, s // tp if sp else s, h, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (b, s))
    with SavedBytes(list(model.parameters())) as saved:
        model.lm_head(model.model.norm(x), labels=labels)
    work = Workload(seq_len=s, global_batch=b, precision="fp32")
    lay = Layout(tp=tp, pp=2, microbatch_size=b, sequence_parallel=sp)
    assert saved.total == head_saved_bytes(cfg, lay, work)


# --------------------------------------------------------------------------------------------
# Bytes per axis: the planner against real runs
# --------------------------------------------------------------------------------------------
EXACT_RUNS = [
    ("dp2_buckets", {"parallel__bucket_mb": "0.05"}),  # several gradient buckets
    ("zero1", {"parallel__zero_stage": 1}),
    ("zero2", {"parallel__zero_stage": 2}),
    ("zero3_accum", {"parallel__zero_stage": 3, "train__micro_batch_size": 2}),
    ("tp2", {"parallel__tp": 2}),
    ("tp2_sp_recompute_kv1", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                              "train__activation_checkpointing": "true",
                              "model__num_key_value_heads": 1}),
    ("tp2_sp_selective", {"parallel__tp": 2, "parallel__sequence_parallel": "true",
                          "train__recompute": "selective"}),
    ("pp2_1f1b", {"parallel__pp": 2, "train__micro_batch_size": 2}),
    ("pp2_interleaved", {"parallel__pp": 2, "parallel__vpp": 2, "model__num_hidden_layers": 4,
                         "parallel__schedule": "interleaved-1f1b", "train__micro_batch_size": 2}),
    ("pp2_tied", {"parallel__pp": 2, "train__micro_batch_size": 4,
                  "model__tie_word_embeddings": "true"}),
    # context parallelism: K/V on "cp", gradients over dp_cp, ZeRO over dp_shard_cp
    ("cp2_ring", {"parallel__cp": 2}),
    ("cp2_ring_recompute_accum", {"parallel__cp": 2, "train__activation_checkpointing": "true",
                                  "train__micro_batch_size": 4}),
    ("cp2_allgather_zero3", {"parallel__cp": 2, "parallel__cp_algorithm": "allgather",
                             "parallel__zero_stage": 3, "train__micro_batch_size": 4}),
]
EXACT_RUNS_4 = [
    ("cp2_tp2_sp_ring", {"parallel__cp": 2, "parallel__tp": 2,
                         "parallel__sequence_parallel": "true"}),
    ("cp2_tp2_allgather", {"parallel__cp": 2, "parallel__tp": 2,
                           "parallel__cp_algorithm": "allgather"}),
    ("cp2_dp2_ring", {"parallel__cp": 2}),
    ("cp2_dp2_zero1_allgather", {"parallel__cp": 2, "parallel__zero_stage": 1,
                                 "parallel__cp_algorithm": "allgather"}),
    ("cp2_hsdp_zero2", {"parallel__cp": 2, "parallel__dp_replicate": 2,
                        "parallel__zero_stage": 2}),
    ("cp2_pp2", {"parallel__cp": 2, "parallel__pp": 2, "train__micro_batch_size": 2}),
    ("pp2_dp2_zero3", {"parallel__pp": 2, "parallel__zero_stage": 3,
                       "train__micro_batch_size": 2}),
    # a V: rank 0 holds the first and the last stage (and a tied weight once)
    ("pp2_zbv_zero3", {"parallel__pp": 2, "parallel__vpp": 2, "parallel__schedule": "zb-v",
                       "parallel__zero_stage": 3, "train__micro_batch_size": 2,
                       "model__num_hidden_layers": 4}),
    ("pp2_dualpipev_tied", {"parallel__pp": 2, "parallel__vpp": 2, "model__num_hidden_layers": 4,
                            "parallel__schedule": "dualpipe-v",
                            "model__tie_word_embeddings": "true",
                            "train__micro_batch_size": 2}),
    ("pp2_interleaved_inflight3", {"parallel__pp": 2, "parallel__vpp": 2,
                                   "parallel__pipeline_inflight": 3,
                                   "parallel__schedule": "interleaved-1f1b",
                                   "model__num_hidden_layers": 4, "train__micro_batch_size": 1}),
]


def _bytes_of_runs(rank, world, corpus, cache, root, runs):
    """Each rank trains every run in this process group; returns rank 0's summaries."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=2,
                                               checkpoint__save_final="false", **extra))
        out[name] = train(cfg, Distributed(cfg))["comm_bytes_per_step"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,runs", [(2, EXACT_RUNS), (4, EXACT_RUNS_4)],
                         ids=["2ranks", "4ranks"])
def test_planner_bytes_equal_runtime_exactly(world, runs, corpus, cache_dir, tmp_path):
    """summary.json's comm_bytes_per_step (rank 0, training traffic) equals the planner's
    comm_bytes_per_step for DP (several buckets), ZeRO 1/2/3 (with accumulation), TP and TP
    with sequence parallelism, recompute and replicated kv heads, pipeline sends (1F1B,
    interleaved), and context parallelism (ring and allgather, with recompute, ZeRO 1/2/3,
    HSDP, TP with and without SP, pp), on 2 and 4 ranks; the dry run prints the same. Every
    axis the runtime reports is one the planner knows."""
    got = run_distributed(_bytes_of_runs, world, corpus, cache_dir, tmp_path, runs,
                          timeout=300)[0]
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / name, **extra))
        mcfg = cfg.model.resolved(cfg.data.vocab_size)
        # summary.json is rank 0's: pipeline stage 0 (the last one has the final norm too)
        want = comm_bytes_per_step(mcfg, Layout.from_config(cfg, world),
                                   Workload.from_config(cfg), stage=0)
        assert set(got[name]) <= set(want), (name, got[name])
        measured = {a: got[name].get(a, 0) for a in want}
        assert measured == {a: float(v) for a, v in want.items()}, name
        assert predict(cfg, world).comm_bytes == want, name  # what the dry run prints
        assert sum(want.values()) > 0, name
        if "parallel__cp" in extra:
            assert want["cp"] > 0 and want["dp"] == want["dp_shard"] == 0, name


def test_dry_run_under_cp_reports_cp_bytes_and_memory(warm, monkeypatch, capsys):
    """``threefold train --dry-run --parallel.cp 4``: the layout line names cp, the bytes on
    "cp" are the closed form's (per layer and microbatch, the forward twice under activation
    checkpointing), ZeRO shards over dp_shard_cp, and splitting the sequence over 4 ranks
    cuts the activations and what the head keeps by 4 against tp alone."""
    from threefold.accounting import cp_bytes_per_attention

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    base = [("model.preset", "llama3-8b"), ("data.seq_len", "32768"),
            ("train.dtype", "bfloat16"), ("train.activation_checkpointing", "true"),
            ("train.global_batch_size", "4"), ("train.micro_batch_size", "1"),
            ("parallel.tp", "2"), ("parallel.sequence_parallel", "true"),
            ("parallel.zero_stage", "1")]
    argv = ["train", "--dry-run", "--nproc-per-node", "8", "--parallel.cp", "4"]
    for k, v in base:
        argv += [f"--{k}", v]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "cp 4 (ring, 8192 tokens of each sequence per rank) × tp 2" in out
    r = predict(load_config(None, base + [("parallel.cp", "4")]), 8)
    kv = 2 * 1 * (8 // 2) * (32768 // 4) * 128 * 2  # K and V: b·kv heads/tp·s/cp·d, bf16
    fwd, bwd = cp_bytes_per_attention(kv, 4, "ring", forwards=2)
    assert r.comm_bytes["cp"] == 32 * 4 * (fwd + bwd) and f"cp {r.comm_bytes['cp']:,}" in out
    assert r.comm_bytes["dp_shard_cp"] > 0 and r.comm_bytes["dp_shard"] == 0
    assert "shards over dp_shard·cp = 4 ranks" in out and "shards over one rank" not in out
    assert r.step is not None and r.step.cp_exposed_s > 0
    alone = predict(load_config(None, base + [("parallel.dp_shard", "4")]), 8)  # no cp
    assert r.memory.activations == pytest.approx(alone.memory.activations / 4, rel=0.02)
    # what the head keeps per token is split 4 ways; the chunked loss's working set does not
    # depend on the tokens: one chunk of 256 MiB of fp32 logits (and its bf16 copy) and the
    # head weight's shard (64,128 rows of 4,096) cast to bf16
    const = 256 * 2**20 * 6 // 4 + 64128 * 4096 * 2
    assert r.memory.logits - const == pytest.approx((alone.memory.logits - const) / 4,
                                                    rel=2e-3)
    allgather = predict(load_config(None, base + [("parallel.cp", "4"),
                                                  ("parallel.cp_algorithm", "allgather")]), 8)
    fwd, bwd = cp_bytes_per_attention(kv, 4, "allgather", forwards=2)
    assert allgather.comm_bytes["cp"] == 32 * 4 * (fwd + bwd)
