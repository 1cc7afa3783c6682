"""The planner and the dry run on mixtures of experts: every expert a rank holds in its memory
(E/ep per block, ZeRO over dp_shard/ep), active FLOPs, the expert-parallel all-to-alls as the
uniform-routing closed form on the link the ep axis crosses, ep searched, MoE refusals named."""

import contextlib

import pytest
import torch

from threefold.layout import Layout, Workload, check_layout
from threefold.layout.rules import LayoutError
from threefold.accounting import (active_parameters, comm_bytes_per_step, flops_per_token,
    layer_parameters_per_rank, matmul_parameters, num_parameters, owned_parameters,
    stage_parameters, tp_shard)
from threefold.config import ModelConfig, load_config
from threefold.model.decoder import CausalLM
from threefold.plan.activations import block_activation_bytes
from threefold.plan.candidates import SearchSpace
from threefold.commands.planning import main
from threefold.plan.cluster import Cluster
from threefold.hardware.catalogue import get_hardware
from threefold.plan.memory import memory_per_gpu, memory_per_rank
from threefold.plan.moe_memory import moe_block_extra_bytes, moe_cast_weight_bytes
from threefold.plan.search import search
from threefold.plan.traps import layout_warnings
from threefold.plan.step import predict_step
from tests.test_tp_layer import SavedBytes

MIXTRAL = ModelConfig(preset="mixtral-8x7b").resolved()
H100 = get_hardware("h100")


def _expert(cfg):
    return 3 * cfg.hidden_size * cfg.intermediate_size


def _small_moe(e=4, k=2, layers=2, h=64, f=64):
    """The model of tests/test_expert_parallel.py's byte check."""
    return ModelConfig(preset="tiny", hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=e, num_experts_per_tok=k).resolved(320)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_ep_divides_expert_memory_by_the_closed_form(zero):
    """Rank 0 holds the dense weights and E/ep experts per block: going from ep 1 to ep
    cuts exactly L·(E − E/ep)·3hf weights (and their bytes, ZeRO-0/1/2's full weights);
    what a rank owns under ZeRO is its 1/(dp_shard/ep) of its E/ep experts: every expert's
    weights over dp_shard whatever ep, padded per block."""
    cfg, work = MIXTRAL, Workload(seq_len=4096, global_batch=64)
    e, L, x = cfg.num_local_experts, cfg.num_hidden_layers, _expert(cfg)
    whole = stage_parameters(cfg, Layout(dp_shard=16, zero_stage=zero), 0)
    assert whole == num_parameters(cfg)
    for ep in (2, 4, 8):
        lay = Layout(dp_shard=16, ep=ep, zero_stage=zero)
        check_layout(cfg, lay, work)
        held = stage_parameters(cfg, lay, 0)
        assert whole - held == L * (e - e // ep) * x
        if zero:  # dense units over dp_shard, the experts of each block over dp_shard/ep
            dense = Layout(dp_shard=16, zero_stage=zero, ep=1)
            ne = 16 // ep
            want = owned_parameters(cfg, lay, 0) - L * -(-(e // ep) * x // ne)
            # the dense units are those of the whole model less the experts
            assert want < owned_parameters(cfg, dense, 0)
        mem1 = memory_per_rank(cfg, Layout(dp_shard=16, zero_stage=zero), work)
        mem = memory_per_rank(cfg, lay, work)
        if zero in (0, 1, 2):  # the full weights of every held expert, 4 bytes (fp32) or 2
            assert mem1.params - mem.params == pytest.approx(
                L * (e - e // ep) * x * 2, rel=1e-6)
        else:  # ZeRO-3 shards: about the same bytes of experts on each rank
            assert mem.params == pytest.approx(mem1.params, rel=0.01)
        if zero:  # sharded over dp_shard either way
            assert mem.optimizer == pytest.approx(mem1.optimizer, rel=0.01)
        else:  # whole on every rank: fp32 master + two moments for each held expert
            assert mem1.optimizer - mem.optimizer == pytest.approx(
                L * (e - e // ep) * x * 12, rel=1e-6)


def test_dense_memory_and_bytes_are_those_of_threefold_memory():
    """A dense model: memory_per_rank is memory_per_gpu, Layout.ep 1 changes nothing and no
    byte goes on the expert axes."""
    cfg = ModelConfig(preset="llama3-8b").resolved()
    work = Workload(seq_len=4096, global_batch=64)
    for lay in (Layout(dp_shard=8), Layout(dp_shard=4, tp=2, zero_stage=3),
                Layout(pp=2, dp_shard=4, zero_stage=1, microbatch_size=2)):
        assert memory_per_rank(cfg, lay, work) == memory_per_gpu(cfg, lay, work)
        b = comm_bytes_per_step(cfg, lay, work)
        assert b["ep"] == b["edp"] == b["edp_shard"] == 0
    with pytest.raises(LayoutError, match="parallel.ep"):
        check_layout(cfg, Layout(dp_shard=8, ep=2), work)


@pytest.mark.parametrize("ep,world,recompute,mbs", [(2, 2, "none", 4), (2, 2, "full", 2),
                                                     (2, 2, "selective", 2),
                                                     (4, 4, "none", 2), (2, 4, "none", 2)])
def test_ep_bytes_equal_the_uniform_routing_closed_form(ep, world, recompute, mbs):
    """Per MoE layer and microbatch of N = b·s tokens, rank 0 sends on "ep"
    4·N·k·(ep−1)/ep·h·4 + E·8·(ep−1)/ep bytes (fp32), 6·… + 2·E·8·… under full recompute
    (selective keeps the all-to-alls' results: no recompute's bytes);
    its experts' gradients all-reduce over edp = dp/ep, the dense ones over dp (the closed
    forms tests/test_expert_parallel.py checks against the runtime's measured bytes)."""
    cfg = _small_moe()
    e, k, h, L = 4, 2, 64, 2
    seq, batch = 64, 8
    work = Workload(seq_len=seq, global_batch=batch, precision="fp32", residual_bytes=4,
                    master_bytes=4)
    lay = Layout(dp_shard=world, ep=ep, microbatch_size=mbs, recompute=recompute)
    check_layout(cfg, lay, work)
    m = batch // (world * mbs)
    n = mbs * seq
    fw = 2 if recompute == "full" else 1
    want_ep = L * m * ((2 * fw + 2) * n * k * (ep - 1) // ep * h * 4
                       + fw * e * 8 * (ep - 1) // ep)
    got = comm_bytes_per_step(cfg, lay, work)

    def all_reduce(numel, g):  # rank 0's share of a ring all-reduce, fp32 (comm.Comm)
        return 0 if g == 1 else 2 * (numel - -(-numel // g)) * 4

    experts = L * e * _expert(cfg)
    assert got["ep"] == want_ep
    assert got["edp"] == all_reduce(experts // ep, world // ep)
    assert got["dp"] == all_reduce(num_parameters(cfg) - experts, world)
    # bf16 matmuls, fp32 residual stream (the runtime's autocast): dispatch and its gradient
    # move the MLP's fp32 input, combine and its gradient the experts' bf16 output
    mixed = Workload(seq_len=seq, global_batch=batch, precision="bf16", residual_bytes=4,
                     master_bytes=4)
    rows = n * k * (ep - 1) // ep * h
    assert comm_bytes_per_step(cfg, lay, mixed)["ep"] == L * m * (
        (fw + 1) * rows * (4 + 2) + fw * e * 8 * (ep - 1) // ep)


def test_zero_expert_units_over_edp_shard():
    """ZeRO 1-3 under ep: each block's experts are one unit over edp_shard = dp_shard/ep
    (padded to it), the dense units over dp_shard; ZeRO-3 gathers the expert unit forward
    and backward, and once more in the recomputed forward."""
    cfg = _small_moe()
    work = Workload(seq_len=64, global_batch=8, precision="fp32", residual_bytes=4,
                    master_bytes=4)
    unit = 2 * _expert(cfg)  # E/ep = 2 experts per rank
    for zero in (1, 2, 3):
        got = comm_bytes_per_step(cfg, Layout(dp_shard=4, ep=2, zero_stage=zero,
                                              microbatch_size=2), work)
        # edp_shard of 2: reduce-scatter + gather(s), (n-1)/n of the unit each, 2 layers
        calls = {1: 2, 2: 2, 3: 3}[zero] * (1 if zero < 3 else 1)  # m = 1 microbatch
        assert got["edp_shard"] == 2 * calls * unit // 2 * 4
    ac = comm_bytes_per_step(cfg, Layout(dp_shard=4, ep=2, zero_stage=3, microbatch_size=2,
                                         recompute="full"), work)
    assert ac["edp_shard"] == 2 * 4 * unit // 2 * 4


def test_moe_flops_are_active_on_every_tp_rank():
    """MFU counts the active parameters (router and k experts per token, PaLM's 6N); the
    hardware FLOPs repeat the MoE on every tp rank (it is not split by tp)."""
    cfg, work = MIXTRAL, Workload(seq_len=4096, global_batch=256)
    assert matmul_parameters(cfg) < active_parameters(cfg) < num_parameters(cfg)
    cluster = Cluster(H100, 64, 8)
    for tp in (1, 2):
        lay = Layout(tp=tp, dp_shard=64 // tp, ep=8, zero_stage=3, sequence_parallel=False)
        s = predict_step(cfg, lay, work, cluster)
        assert s.model_flops == flops_per_token(cfg, 4096) * work.tokens
        if tp == 1:
            hf1 = s.hardware_flops
        else:  # attention split, MoE repeated: more than tp=1's, less than twice
            assert hf1 < s.hardware_flops < 2 * hf1
        assert 0 < s.mfu < 1 and s.ep_exposed_s > 0


def test_ep_across_nodes_is_slower_and_flagged():
    """An ep group that leaves the node runs its all-to-alls at the network's bandwidth and is
    warned about, as tp across nodes is."""
    cfg, work = MIXTRAL, Workload(seq_len=4096, global_batch=256)
    lay = Layout(tp=2, dp_shard=32, ep=8, zero_stage=3, sequence_parallel=False)
    inside = predict_step(cfg, lay, work, Cluster(H100, 64, 16))
    across = predict_step(cfg, lay, work, Cluster(H100, 64, 8))
    assert "ep" not in inside.inter_node_axes and "ep" in across.inter_node_axes
    assert across.ep_exposed_s > 3 * inside.ep_exposed_s
    assert inside.comm_bytes["ep"] == across.comm_bytes["ep"] > 0
    mem = memory_per_rank(cfg, lay, work)
    warnings = layout_warnings(cfg, lay, mem, across, Cluster(H100, 64, 8))
    assert any(w.startswith("ep crosses nodes") for w in warnings)
    assert not any("ep crosses" in w for w in layout_warnings(cfg, lay, mem, inside,
                                                              Cluster(H100, 64, 16)))


def test_moe_layouts_the_runtime_refuses_are_refused_by_name():
    cfg, work = MIXTRAL, Workload(seq_len=4096, global_batch=64)
    cases = [(Layout(tp=2, dp_shard=4), "parallel.sequence_parallel"),
             (Layout(dp_shard=6, ep=3), "parallel.ep"),
             (Layout(dp_shard=2, ep=4), "parallel.ep")]
    for lay, field in cases:
        with pytest.raises(LayoutError, match=field):
            check_layout(cfg, lay, work)
    check_layout(cfg, Layout(tp=2, dp_shard=4, ep=4, pp=2, sequence_parallel=False), work)
    check_layout(cfg, Layout(dp_shard=4, cp=2, ep=2), work)  # experts route a cp share too


def test_planner_searches_ep_for_mixtral_on_64_gpus():
    """Every layout ranked is one the runtime takes (ep dividing the experts and dp_shard, no
    SP) and fits; ep > 1 is searched, and, keeping every activation or recomputing
    whole blocks, it wins: holding 1/ep of the experts leaves room that ep = 1 (every expert
    on every rank, or gathered by ZeRO-3) does not. (Selective recompute makes room at ep 1
    too: a near tie, within 0.1%.)"""
    cluster = Cluster(H100, 64, 8)
    work = Workload(seq_len=4096, global_batch=1024)
    with_selective = search(MIXTRAL, cluster, work, keep=5).ranked[0]
    res = search(MIXTRAL, cluster, work, SearchSpace(recompute=("none", "full")), keep=5)
    assert res.ranked and res.fits > 0
    for c in res.ranked:
        lay = c.layout
        assert 8 % lay.ep == 0 and lay.dp_shard % lay.ep == 0 and not lay.sp
        assert c.memory.total <= H100.memory_bytes
    best = res.ranked[0]
    only1 = search(MIXTRAL, cluster, work, SearchSpace(ep=(1,), recompute=("none", "full")),
                   keep=1).ranked[0]
    assert best.layout.ep > 1 and best.step.step_time_s < only1.step.step_time_s
    assert with_selective.step.step_time_s <= best.step.step_time_s < \
        1.001 * with_selective.step.step_time_s
    assert best.step.comm_bytes["ep"] > 0


def test_plan_cli_for_moe(capsys):
    """``threefold plan`` ranks MoE layouts with an ep column and says the ep figures are
    the uniform-routing expectation; --cp 2 ranks MoE layouts under context parallelism;
    a bad --ep is refused by the rule book's message (the field it sets)."""
    assert main(["--model", "olmoe-shape-1b-7b", "--gpus", "16", "--gpu", "h100",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "1.28B active" in out and " ep " in out and "uniform-routing" in out
    assert main(["--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100", "--cp", "2",
                 "--top", "1"]) == 0
    assert " ep " in capsys.readouterr().out
    assert main(["--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h100", "--ep", "3"]) == 2
    assert "parallel.ep: 3 does not divide model.num_local_experts=8" in capsys.readouterr().err


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    """["--a", "1", "--b", "2"] -> [("a", "1"), ("b", "2")] (load_config's overrides)."""
    return [(k.removeprefix("--"), v) for k, v in zip(argv[::2], argv[1::2])]


def test_dry_run_of_mixtral_with_ep(monkeypatch, tmp_path):
    """The dry run of Mixtral on 64 ranks with ep 8: rank 0's parameters counted on the meta
    model cut by apply_expert_parallel equal the planner's, the bytes on ep are the closed
    form, MFU counts active parameters."""
    from threefold.launch.dryrun import predict
    from threefold.launch.dryrun_report import format_report

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, _pairs(["--model.preset", "mixtral-8x7b", "--parallel.ep", "8",
                             "--parallel.zero_stage", "3", "--train.global_batch_size", "64",
                             "--train.micro_batch_size", "1", "--data.seq_len", "4096",
                             "--train.dtype", "bfloat16",
                             "--train.output_dir", str(tmp_path)]))
    r = predict(cfg, 64)
    e, k, h, L = 8, 2, 4096, 32
    assert r.parameters_per_rank == stage_parameters(r.model, r.layout, 0) \
        == num_parameters(r.model) - L * (e - 1) * _expert(r.model)
    n = 4096  # tokens per micro-batch
    # bf16 compute under ZeRO-3 holds bf16 parameters (parallel.param_dtype auto), so the
    # residual stream the rows travel in is bf16 too: 2 + 2 bytes per element each way
    assert r.comm_bytes["ep"] == L * (2 * n * k * 7 // 8 * h * (2 + 2) + e * 8 * 7 // 8)
    assert r.step is not None and r.step.ep_exposed_s > 0
    assert r.step.model_flops == flops_per_token(r.model, 4096) * 64 * 4096
    text = format_report(r, 64)
    assert "ep 8 inside dp_shard" in text and "uniform-routing" in text
    assert f"ep {r.comm_bytes['ep']:,}" in text and "12.88B of 46.70B" in text


def test_dry_run_of_moe_under_cp(monkeypatch, tmp_path):
    """Mixtral under cp 2 × ep 2 on 8 ranks: per micro-batch and block, cp moves the ring's
    closed form and the router statistics pooled over cp (an fp32 all-reduce of 2E + 1
    per block, forward and backward)."""
    from threefold.accounting import cp_bytes_per_attention
    from threefold.launch.dryrun import predict

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    cfg = load_config(None, _pairs(["--model.preset", "mixtral-8x7b", "--parallel.cp", "2",
                                    "--parallel.ep", "2", "--parallel.zero_stage", "3",
                                    "--data.seq_len", "4096", "--train.dtype", "bfloat16",
                                    "--train.global_batch_size", "8",
                                    "--train.micro_batch_size", "1",
                                    "--train.output_dir", str(tmp_path)]))
    r = predict(cfg, 8)
    kv = 2 * 1 * 8 * 2048 * 128 * 2  # K and V: b · kv heads · s/cp · head_dim, bf16
    fwd, bwd = cp_bytes_per_attention(kv, 2, "ring")
    pooled = 2 * (32 * 17 // 2) * 4  # rank 0 sends the half of 32·(2·8 + 1) fp32 it lacks
    assert r.comm_bytes["cp"] == 2 * 32 * (fwd + bwd) + 2 * 2 * pooled
    assert r.comm_bytes["ep"] > 0 and r.comm_bytes["edp_shard"] > 0


def _first_block_saved(model, b: int, s: int, h: int, dtype):
    """(the bytes autograd saves, the input) of the first block's forward on random (b, s, h)
    input under ``dtype``'s autocast (``SavedBytes``)."""
    x = torch.randn(b, s, h, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    with SavedBytes(list(model.parameters())) as saved, auto:
        model.model.layers[0](x, cos, sin)
    return saved, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("e,k", [(8, 2), (16, 4)])
def test_moe_block_activation_bytes_equal_autograd_saved_tensors(e, k, dtype):
    """Every byte autograd saves in one MoE block (weights excluded) is the dense block's
    count with the MoE's in place of the SwiGLU (``moe_block_extra_bytes``), plus the RoPE
    tables (fp32) or the autocast weight copies, the experts' and router's among them
    (``moe_cast_weight_bytes``)."""
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", vocab_size=512, num_local_experts=e,
                      num_experts_per_tok=k).resolved()
    model = CausalLM(cfg)
    b, s, h = 2, 64, cfg.hidden_size
    saved, x = _first_block_saved(model, b, s, h, dtype)
    d = 2 if dtype == torch.bfloat16 else 4
    sh = tp_shard(cfg, 1)
    work = Workload(seq_len=s, global_batch=b, precision="bf16" if d == 2 else "fp32",
                    residual_bytes=4, master_bytes=4, backend_copies=True,  # a CPU's eager
                    eager=True)  # run: its experts grouped in fp32 too (grouped_experts_run)
    lay = Layout(microbatch_size=b)
    want = block_activation_bytes(b * s, h, sh.heads, sh.kv_heads, cfg.head_dim, sh.ffn, 1,
                                  False, act_bytes=d, residual_bytes=4)
    want += moe_block_extra_bytes(cfg, lay, work)
    if d == 4:
        want += 2 * 4 * b * s * cfg.head_dim
    else:
        want += d * layer_parameters_per_rank(cfg, 1)[0] \
            + moe_cast_weight_bytes(cfg, lay, work, 0) / cfg.num_hidden_layers
    assert saved.total == want


def _kept_bytes(kept: list, skip: list) -> int:
    """Bytes of the distinct storages among the tensors a selective block kept."""
    seen = {t.untyped_storage().data_ptr() for t in skip}
    total = 0
    for _op, out, _v in kept:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_selective_moe_block_bytes_equal_what_the_block_keeps(monkeypatch, impl, dtype):
    """Under selective recompute an MoE block keeps its input and what its ``_Keep`` holds
    (the matmuls' outputs, the router's choice), nothing autograd saves besides but the RoPE
    tables: together,
    to the byte, the dry run's selective count (``model_layer_activation_bytes``, MoE terms
    ``plan.selective.moe_kept``); full recompute's count stays the block's input."""
    from threefold.parallel.transforms import recompute
    from threefold.plan.activations import model_layer_activation_bytes

    keeps = []
    init = recompute._Keep.__init__
    monkeypatch.setattr(recompute._Keep, "__init__",
                        lambda self, kept, *more: (keeps.append(kept), init(self, kept, *more))[1])
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", vocab_size=512, num_local_experts=8, num_experts_per_tok=2,
                      moe_impl=impl).resolved()
    model = CausalLM(cfg)
    recompute.apply_recompute(model, "selective")
    b, s, h = 2, 64, cfg.hidden_size
    saved, x = _first_block_saved(model, b, s, h, dtype)
    rope = 2 * 4 * b * s * cfg.head_dim  # the cos and sin tables, checkpoint inputs too
    assert saved.total == 4 * b * s * h + rope  # autograd saves the checkpoint's inputs only
    d = 2 if dtype == torch.bfloat16 else 4
    work = Workload(seq_len=s, global_batch=b, precision="bf16" if d == 2 else "fp32",
                    residual_bytes=4, master_bytes=4, flash_attention=True)
    lay = Layout(microbatch_size=b, recompute="selective")
    assert len(keeps) == 1 and keeps[0]
    got = saved.total + _kept_bytes(keeps[0], [x, *model.parameters()])
    assert got - rope == model_layer_activation_bytes(cfg, lay, work)
    full = Layout(microbatch_size=b, recompute="full")
    assert model_layer_activation_bytes(cfg, full, work) == 4 * b * s * h


# Qwen3-235B-A22B's shape (Hugging Face config): 94 blocks of width 4,096, 64 query and 4
# key/value heads of 128, 128 experts of width 1,536, 8 per token, vocabulary 151,936.
QWEN3_235B = dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                  num_key_value_heads=4, attention_head_dim=128, intermediate_size=1536,
                  num_local_experts=128, num_experts_per_tok=8, vocab_size=151936, qk_norm=True)


@pytest.mark.parametrize("bad,message", [
    (dict(ep=32), "parallel.ep: 32 does not divide parallel.dp_shard=16 (expert-parallel "
                  "ranks are data-parallel ranks of one shard group); valid ep values: 1, 2, "
                  "4, 8, 16"),  # was a ZeroDivisionError
    (dict(ep=3), "parallel.ep: 3 does not divide model.num_local_experts=128; use an ep in 1, "
                 "2, 4, 8, 16"),  # was a prediction for 128/3 experts per rank
    (dict(ep=8, vpp=2), "parallel.vpp: 2 model chunks per stage need pipeline stages; set "
                        "parallel.pp > 1 or parallel.vpp 1")])
def test_the_planners_entry_points_refuse_a_bad_layout_by_its_rule(bad, message):
    """A layout built by hand and given to the planner's Python entry points (the step, the
    memory per rank, GPU or stage, start-up's peaks, the bytes per axis) is refused by the
    rule book's rule with its message, before any formula divides by a degree that cannot be."""
    from threefold.plan.memory import stage_memory
    from threefold.plan.startup import startup_peaks

    cfg = ModelConfig(preset="tiny", **QWEN3_235B).resolved()
    lay = Layout(tp=4, dp_shard=16, sequence_parallel=False, zero_stage=3, **bad)
    work, cluster = Workload(seq_len=4096, global_batch=64), Cluster(H100, 64, 8)
    for call in (lambda: predict_step(cfg, lay, work, cluster),
                 lambda: memory_per_rank(cfg, lay, work), lambda: memory_per_gpu(cfg, lay, work),
                 lambda: stage_memory(cfg, lay, work, 0), lambda: startup_peaks(cfg, lay, work),
                 lambda: comm_bytes_per_step(cfg, lay, work)):
        with pytest.raises(LayoutError) as refused:
            call()
        assert str(refused.value) == message
    good = Layout(tp=4, dp_shard=16, sequence_parallel=False, zero_stage=3, ep=16)
    assert predict_step(cfg, good, work, cluster).step_time_s > 0
    assert memory_per_rank(cfg, good, work).total > 0
