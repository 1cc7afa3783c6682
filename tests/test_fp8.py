"""FP8 training (``train.fp8``, threefold/parallel/transforms/fp8_linear.py): each layer within the error its
recipe's casts allow, against an exact (float64) matmul; the model trains as bf16 does; every
parallel layout equals one process under the same recipe; bad combinations are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.layout import Layout, Workload
from threefold.accounting import comm_bytes_per_step
from threefold.config import ConfigError, load_config
from threefold.parallel.transforms.fp8_linear import Float8Linear, apply_fp8, fp8_linear
from threefold.training.train import train

STEPS = 2


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread, as each rank of a launch uses: torch._scaled_mm's CPU kernel spins
    its threads, and on a shared 2-core machine a 256×64×64 product then takes 40 ms, not
    0.1 ms."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bound(a: torch.Tensor, b: torch.Tensor, rel_a: float, rel_b: float, tiny_a: float,
           tiny_b: float) -> torch.Tensor:
    """The largest error of a·b when each element of a (b) is cast with a relative error of
    at most rel_a (rel_b) or, below the format's normal range, an absolute one of tiny_a
    (tiny_b): |Δ(a·b)| ≤ (rel_a + rel_b + rel_a·rel_b)·|a|·|b| + tiny_a·(1+rel_b)·1·|b|
    + tiny_b·(1+rel_a)·|a|·1 + tiny_a·tiny_b·k, plus float32 accumulation (k·2⁻²⁴·|a|·|b|)."""
    aa, ab = a.abs().double(), b.abs().double()
    k = a.shape[1]
    return ((rel_a + rel_b + rel_a * rel_b + k * 2.0 ** -24) * (aa @ ab)
            + tiny_a * (1 + rel_b) * ab.sum(0, keepdim=True)
            + tiny_b * (1 + rel_a) * aa.sum(1, keepdim=True) + tiny_a * tiny_b * k)


# e4m3 keeps 3 mantissa bits (rounding: relative error ≤ 2⁻⁴), e5m2 2 (≤ 2⁻³); below the
# normal range the step is the smallest subnormal (e4m3 2⁻⁹, e5m2 2⁻¹⁶) in scaled units, so
# half of it divided by the scale (448/amax or 57344/amax; a rowwise scale is at most 2×
# smaller than its tensor's: rounded down to a power of 2 of a row's amax ≤ the tensor's)
E4M3 = (2.0 ** -4, 2.0 ** -10 / 448 * 2)
E5M2 = (2.0 ** -3, 2.0 ** -17 / 57344 * 2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_layer_forward_and_gradients_within_the_recipes_error(recipe):
    torch.manual_seed(0)
    x = (torch.randn(48, 64) * torch.logspace(-2, 1, 64)).requires_grad_()  # uneven columns
    w = (torch.randn(32, 64) * 0.05).requires_grad_()
    b = torch.randn(32, requires_grad=True)
    dy = torch.randn(48, 32)
    y = fp8_linear(x, w, b, recipe)
    y.backward(dy)
    x64, w64 = x.detach().double(), w.detach().double()
    g = E5M2 if recipe == "tensorwise" else E4M3  # the output gradient's format
    ax, aw, ag = x.abs().max().item(), w.abs().max().item(), dy.abs().max().item()
    checks = [
        (y.detach() - b.detach(), x64 @ w64.T, _bound(x, w.T, E4M3[0], E4M3[0],
                                                        E4M3[1] * ax, E4M3[1] * aw)),
        (x.grad, dy.double() @ w64, _bound(dy, w, g[0], E4M3[0], g[1] * ag, E4M3[1] * aw)),
        (w.grad, dy.double().T @ x64, _bound(dy.T, x, g[0], E4M3[0], g[1] * ag, E4M3[1] * ax)),
    ]
    for name, (got, want, bound) in zip(["y", "dx", "dW"], checks):
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (recipe, name, float((err / bound).max()))
        # and the casts did round: FP8 ran, not the float32 matmul
        assert err.max() > 1e-4 * want.abs().max(), (recipe, name)


def test_layers_made_fp8_print_and_odd_widths_stay_high_precision():
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({
        "q_proj": nn.Linear(64, 64), "o_proj": nn.Linear(64, 40), "router": nn.Linear(64, 64)})])
    kept = apply_fp8(model, "rowwise")
    layer = model.model.layers[0]
    assert type(layer["q_proj"]) is Float8Linear and "fp8 rowwise" in repr(model)
    # 40 output features: not a multiple of 16 (torch._scaled_mm's CUDA rule): kept, and
    # neither a router nor anything outside TARGETS is touched
    assert kept == ["0.o_proj"] and type(layer["o_proj"]) is nn.Linear
    assert type(layer["router"]) is nn.Linear
    x = torch.randn(5, 64)  # 5 tokens: the weight gradient's matmul takes the fp32 path
    y = layer["q_proj"](x.requires_grad_())
    y.sum().backward()
    ref = F.linear(x, layer["q_proj"].weight, layer["q_proj"].bias)
    torch.testing.assert_close(y, ref, rtol=0.2, atol=0.2)
    assert not torch.equal(y, ref)


def test_a_lora_layer_runs_its_frozen_base_in_fp8_and_its_adapter_as_before():
    from threefold.config import LoRAConfig
    from threefold.model.lora import apply_lora
    from threefold.parallel.transforms.fp8_linear import Float8LoRALinear

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"v_proj": nn.Linear(64, 32)})])
    apply_lora(model, LoRAConfig(r=4, target_modules="v_proj"))
    apply_fp8(model, "tensorwise")
    layer = model.model.layers[0]["v_proj"]
    assert isinstance(layer, Float8LoRALinear) and "lora r=4, scale" in repr(layer)
    torch.nn.init.normal_(layer.lora_B.weight)  # (B starts at zero: make the adapter count)
    x = torch.randn(16, 64)
    y = layer(x)
    y.sum().backward()
    a, b = layer.lora_A.weight, layer.lora_B.weight
    want = fp8_linear(x, layer.weight, layer.bias, "tensorwise") + x @ a.T @ b.T * layer.lora_scale
    torch.testing.assert_close(y, want)
    assert layer.weight.grad is None and layer.lora_A.weight.grad is not None


@pytest.mark.parametrize("overrides,match", [
    ([("train.fp8", "e4m3")], "train.fp8: unknown value 'e4m3'"),
    ([("train.fp8", "rowwise"), ("lora.r", "8"), ("parallel.tp", "2")],
     "train.fp8: rowwise with lora.r > 0 and parallel.tp > 1"),
    ([("train.fp8", "rowwise"), ("parallel.zero_stage", "3"), ("parallel.fp8_all_gather", "true")],
     "parallel.fp8_all_gather: true does not apply with train.fp8 rowwise"),
    ([("train.fp8", "tensorwise"), ("parallel.zero_stage", "2"),
      ("parallel.fp8_all_gather", "true")],
     "parallel.fp8_all_gather: true does not apply with parallel.zero_stage 2"),
    ([("model.preset", "tiny-moe"), ("train.fp8", "tensorwise"), ("parallel.zero_stage", "3"),
      ("parallel.fp8_all_gather", "true")],
     "parallel.fp8_all_gather: true is not available for a mixture of experts"),
])
def test_bad_fp8_settings_are_refused_by_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_fp8_all_gather_is_on_where_it_applies_and_off_for_a_mixture_of_experts():
    """Unset, the 8-bit gather resolves on for a dense model under tensorwise and ZeRO-3, off
    for a mixture of experts (which gathers in param_dtype) and off when set false."""
    from threefold.config import fp8_all_gather

    on = [("train.fp8", "tensorwise"), ("parallel.zero_stage", "3")]
    assert fp8_all_gather(load_config(None, on))
    assert not fp8_all_gather(load_config(None, on + [("model.preset", "tiny-moe")]))
    assert not fp8_all_gather(load_config(None, on + [("parallel.fp8_all_gather", "false")]))
    assert not fp8_all_gather(load_config(None, [("train.fp8", "rowwise"),
                                                 ("parallel.zero_stage", "3")]))


def _run(corpus, cache, out, **extra):
    cfg = load_config(None, tiny_overrides(corpus, cache, out, **extra))
    train(cfg)
    return [r["loss"] for r in metrics(out)]


def test_tiny_trains_with_fp8_as_with_bf16(corpus, cache_dir, tmp_path):
    """30 steps of the tiny model: each recipe's final loss within 3% of bf16's."""
    common = dict(train__steps=30, train__dtype="bfloat16")
    bf16 = _run(corpus, cache_dir, tmp_path / "bf16", **common)
    for recipe in ("tensorwise", "rowwise"):
        fp8 = _run(corpus, cache_dir, tmp_path / recipe, train__fp8=recipe, **common)
        assert fp8[-1] == pytest.approx(bf16[-1], rel=0.03), recipe
        assert fp8 != bf16, recipe  # FP8 ran: the losses differ from bf16's


# Each layout's single-process reference runs the micro-batches the layout's ranks run (a
# micro-batch's amax is its own: DP's ranks scale their own samples, as torchao does).
# Tensor parallelism agrees the amaxes (checked exact per layer below), but a row-parallel
# layer sums its partial products in another order, and an FP8 cast downstream can round
# the last-bit difference to the neighbouring fp8 value (2⁻³ of it under e5m2); through Adam's
# normalised first step such an element moves by ±lr. So a tp run is compared after 1 step:
# the loss exactly as fp32, and at most 5% of each weight's' elements outside the fp32
# tolerance (k_proj's small gradients flip most), none by more than 2·lr.
RUNS_2 = [  # name, overrides, the reference's micro-batch, steps
    ("dp2_rowwise", {"train__fp8": "rowwise"}, 4, STEPS),
    ("zero3_rowwise", {"train__fp8": "rowwise", "parallel__zero_stage": 3}, 4, STEPS),
    ("pp2_tensorwise", {"train__fp8": "tensorwise", "parallel__pp": 2,
                        "train__micro_batch_size": 2}, 2, STEPS),
    # parallel.fp8_all_gather (on by default here): the weights gathered in e4m3, read
    # again by the recomputed forward inside backward
    ("zero3_tensorwise_8bit_gather_ac", {"train__fp8": "tensorwise", "parallel__zero_stage": 3,
                                         "train__micro_batch_size": 2,
                                         "train__recompute": "full"}, 2, STEPS),
    ("tp2_sp_tensorwise_compile_ac", {"train__fp8": "tensorwise", "parallel__tp": 2,
                                      "parallel__sequence_parallel": "true",
                                      "train__compile": "true", "train__recompute": "full"},
     8, 1),
    ("tp2_sp_rowwise", {"train__fp8": "rowwise", "parallel__tp": 2,
                        "parallel__sequence_parallel": "true"}, 8, 1),
]


def _grads(x, w, dy, recipe, comm=None, split="", weight8=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, None, recipe, comm, split, weight8)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _split_layer_errors(rank: int, world: int) -> dict:
    """One layer split by columns and by rows over tp against the whole layer: the largest
    relative error of y, dx and dW, with the amaxes agreed over tp ("synced") and with each
    rank's own ("own", what the agreement is for)."""
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh

    dims = Layout(tp=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=gen) * torch.linspace(0.1, 3, 64)  # shards' amaxes differ
    w = torch.randn(48, 64, generator=gen) * torch.linspace(3, 0.1, 48)[:, None]
    dy = torch.randn(40, 48, generator=gen) * torch.linspace(0.1, 3, 48)
    cols, rows = slice(rank * 24, rank * 24 + 24), slice(rank * 32, rank * 32 + 32)

    def summed(t):
        comm.all_reduce(t, "tp")  # what g (row) and f (column) do to the partial sums
        return t

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    out = {}
    for recipe in ("tensorwise", "rowwise"):
        y, dx, dw = _grads(x, w, dy, recipe)
        for mode, c in (("synced", comm), ("own", None)):
            yc, dxc, dwc = _grads(x, w[cols], dy[:, cols], recipe, c, "column" if c else "")
            yr, dxr, dwr = _grads(x[:, rows], w[:, rows], dy, recipe, c, "row" if c else "")
            out[recipe, mode] = max(rel(yc, y[:, cols]), rel(summed(dxc), dx),
                                    rel(dwc, dw[cols]), rel(summed(yr), y),
                                    rel(dxr, dx[:, rows]), rel(dwr, dw[:, rows]))
    # blockwise with 256-wide shards (two whole tiles each): every rank's own tiles are the
    # whole layer's, with no amax agreed (the rule book's blockwise_tiles_over_tp)
    k = 256 * world
    xb = torch.randn(40, k, generator=gen) * torch.linspace(0.1, 3, k)
    wb = torch.randn(k, k, generator=gen) * torch.linspace(3, 0.1, k)[:, None]
    dyb = torch.randn(40, k, generator=gen) * torch.linspace(0.1, 3, k)
    part = slice(rank * 256, rank * 256 + 256)
    y, dx, dw = _grads(xb, wb, dyb, "blockwise")
    yc, dxc, dwc = _grads(xb, wb[part], dyb[:, part], "blockwise")
    yr, dxr, dwr = _grads(xb[:, part], wb[:, part], dyb, "blockwise")
    out["blockwise", "own"] = max(rel(yc, y[:, part]), rel(summed(dxc), dx),
                                  rel(dwc, dw[part]), rel(summed(yr), y),
                                  rel(dxr, dx[:, part]), rel(dwr, dw[:, part]))
    return out


def _layouts(rank, world, corpus, cache, root, runs):
    from threefold.parallel.distributed_world import Distributed

    out = {"split_layer": _split_layer_errors(rank, world)}
    for name, extra, _, steps in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=steps,
                                               **extra))
        out[name] = train(cfg, Distributed(cfg))["comm_bytes_per_step"]
    return out


def _check_weights(name, got, want, steps):
    for k, ref in want.items():
        if steps > 1:
            torch.testing.assert_close(got[k], ref, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
            continue
        off = (got[k] - ref).abs() > 2e-5 + 1e-4 * ref.abs()
        assert off.float().mean() <= 0.05, (name, k)
        assert (got[k] - ref).abs().max() <= 2 * 3e-3 / 2, (name, k)  # lr at step 1: 3e-3/2


def test_layouts_equal_one_process_under_fp8(corpus, cache_dir, tmp_path):
    results = run_distributed(_layouts, 2, corpus, cache_dir, tmp_path, RUNS_2, timeout=400)
    for recipe in ("tensorwise", "rowwise"):
        for r in results:  # agreed amaxes: the split layer computes what the whole one does
            assert r["split_layer"][recipe, "synced"] < 1e-5, recipe
        # tensorwise: each rank's own amax would change the scales' rounding. (Rowwise's
        # scales are powers of 2, so a shard's own scale casts its normal-range values to
        # the same fp8 bits; the agreement matters only for the subnormal tail.)
        assert results[0]["split_layer"]["tensorwise", "own"] > 1e-3
    for r in results:
        assert r["split_layer"]["blockwise", "own"] < 1e-5
    refs = {}
    for name, extra, micro, steps in RUNS_2:
        key = (extra["train__fp8"], micro, steps)
        if key not in refs:
            out = tmp_path / "ref_{}_{}_{}".format(*key)
            refs[key] = (_run(corpus, cache_dir, out, train__steps=steps, train__fp8=key[0],
                              train__micro_batch_size=micro), final_weights(out))
        losses, weights = refs[key]
        assert [r["loss"] for r in metrics(tmp_path / name)] == \
            pytest.approx(losses, rel=1e-5), name
        _check_weights(name, final_weights(tmp_path / name), weights, steps)
        # the bytes rank 0 sent per step, the amaxes' all-reduces over tp included, are the
        # planner's (and the dry run's)
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / name, **extra))
        want = comm_bytes_per_step(cfg.model.resolved(cfg.data.vocab_size),
                                   Layout.from_config(cfg, 2), Workload.from_config(cfg), stage=0)
        assert {a: results[0][name].get(a, 0) for a in want} == \
            {a: float(v) for a, v in want.items()}, name


def test_the_planner_times_fp8_at_the_fp8_peak_and_refuses_gpus_without_it():
    from dataclasses import replace

    from threefold.layout import Layout
    from threefold.commands.planning import load_model
    from threefold.plan.compute import fp8_flops_fraction, matmul_peak
    from threefold.plan.cluster import Cluster
    from threefold.hardware.catalogue import get_hardware
    from threefold.plan.step import predict_step
    from threefold.layout import Workload

    cfg, h100 = load_model("llama3-8b"), get_hardware("h100")
    assert h100.peak_flops("fp8") == 1979e12 and h100.peak_flops("bf16") == 989e12
    work = Workload(seq_len=4096, global_batch=64)
    fp8 = replace(work, fp8="tensorwise")
    f = fp8_flops_fraction(cfg, work)
    assert 0.5 < f < 1  # the projections dominate an 8B model's FLOPs; attention/head do not
    # one rate for the mix: FP8's share at 1979 TF/s, the rest at 989
    assert matmul_peak(cfg, fp8, h100) == pytest.approx(1 / (f / 1979e12 + (1 - f) / 989e12))
    layout = Layout(tp=8, dp_shard=1)
    cluster = Cluster(h100, 8, 8)
    a, b = predict_step(cfg, layout, work, cluster), predict_step(cfg, layout, fp8, cluster)
    assert b.compute_s < a.compute_s
    for gpu in ("a100", "v100"):
        with pytest.raises(ValueError, match=f"train.fp8 tensorwise: {gpu} has no FP8"):
            predict_step(cfg, layout, fp8, Cluster(get_hardware(gpu), 8, 8))


def test_a_blocks_saved_bytes_under_fp8_are_the_planners():
    """FP8 keeps what the plain block keeps (the input and weight, cast again in backward)
    and, tensorwise, two fp32 scales per projection: the planner's count, to the byte."""
    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Layout, Workload
    from threefold.config import ModelConfig
    from threefold.model.decoder import CausalLM
    from threefold.plan.activations import model_layer_activation_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=256, num_hidden_layers=1).resolved()
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    for recipe in ("none", "tensorwise", "rowwise"):
        model = CausalLM(cfg)
        apply_fp8(model, recipe)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        with SavedBytes(list(model.parameters())) as saved:
            model.model.layers[0](x, cos, sin, None)
        want = model_layer_activation_bytes(cfg, Layout(microbatch_size=b), Workload(
            s, b, precision="fp32", residual_bytes=4, fp8=recipe))
        assert saved.total == want + 2 * 4 * b * s * cfg.head_dim, recipe  # + RoPE's tables


def test_the_dry_run_refuses_fp8_on_a_gpu_without_it(monkeypatch, tmp_path):
    from threefold.launch.dryrun import dry_run

    overrides = [("model.preset", "tiny"), ("data.vocab_size", "512"), ("train.fp8", "rowwise"),
                 ("train.dtype", "bfloat16"), ("train.output_dir", str(tmp_path))]
    monkeypatch.setenv("THREEFOLD_HARDWARE", "a100")
    with pytest.raises(ConfigError, match="train.fp8 rowwise: a100 has no FP8 tensor cores"):
        dry_run(load_config(None, overrides), 1, out=lambda _: None)
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    lines: list[str] = []
    assert dry_run(load_config(None, overrides), 1, out=lines.append) == 0
    assert "\nstep: " in "\n".join(lines)  # timed, at the FP8 mix's peak


def test_a_block_gathered_in_8_bits_computes_as_before_and_holds_the_planners_bytes(
        corpus, cache_dir, tmp_path):
    """One process (a shard axis of one): a block's ZeRO-3 unit under parallel.fp8_all_gather
    holds its FP8 weights in e4m3 and the rest in float32, the bytes the planner's gathered
    unit term predicts; each FP8 layer's output and input gradient from the gathered e4m3
    weight and scale are bit-identical to casting the float32 weight itself."""
    from threefold.accounting import stage_units
    from threefold.accounting.fp8 import fp8_gathered_numels
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.fp8_cast import E4M3, _cast, _scale
    from threefold.parallel.engines.fp8_gather import Fp8FlatUnit, GatheredWeight
    from threefold.plan.memory import gathered_unit_bytes

    cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path, train__fp8="tensorwise",
                                           parallel__zero_stage=3))
    mcfg = cfg.model.resolved(cfg.data.vocab_size)
    torch.manual_seed(0)
    model = CausalLM(mcfg)
    apply_fp8(model, "tensorwise")
    block = model.model.layers[0]
    layers = {id(m.weight): m for m in block.modules() if isinstance(m, Float8Linear)}
    plain = {i: m.weight.detach().clone() for i, m in layers.items()}
    dims = Layout(tp=1)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    unit = Fp8FlatUnit("block0", list(block.named_parameters()), comm, "dp_shard", 3,
                       set(layers))
    unit.wait_gather()
    held = unit.full.untyped_storage().nbytes() + unit.rest_full.untyped_storage().nbytes()
    predicted = gathered_unit_bytes(stage_units(mcfg, Layout.from_config(cfg, 1), 0)[1], 1, 4,
                                    fp8_gathered_numels(mcfg))
    assert held == predicted < 4 * sum(p.numel() for p in block.parameters())
    assert len(unit.fp8_index) == 7 == len(fp8_gathered_numels(mcfg))
    x = torch.randn(24, mcfg.hidden_size)
    for j in unit.fp8_index:
        layer = layers[id(unit.params[j])]
        xi = x if layer.in_features == x.shape[1] else torch.randn(24, layer.in_features)
        dy = torch.randn(24, layer.out_features)
        got = _grads(xi, layer.weight.detach(), dy, "tensorwise",
                     weight8=GatheredWeight(unit, j))
        want = _grads(xi, plain[id(layer.weight)], dy, "tensorwise")
        for a, b in zip(got[:2], want[:2]):  # y and dx bit for bit
            assert torch.equal(a, b), unit.names[j]
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)  # dW as before
        # the gathered bytes are the layer's own cast: scale from the whole weight's amax
        w8, scale = unit.fp8_weight(j)
        w = plain[id(layer.weight)]
        assert torch.equal(scale, _scale(w.abs().amax(), E4M3, False)), unit.names[j]
        assert torch.equal(w8.view(torch.uint8), _cast(w, scale, E4M3).view(torch.uint8))
    unit.release()
    assert unit.full.untyped_storage().nbytes() == 0 == unit.rest_full.untyped_storage().nbytes()
