"""FP8 for the routed experts (threefold/parallel/transforms/fp8_experts.py) and DeepSeek-V3's
blockwise recipe (fp8_blockwise.py): the blockwise numerics against exact and dequantised
references, each expert computed exactly as an FP8 linear layer of its own, the grouped FP8
kernel's arguments through torch's own checks, the planner's FP8 share and scale bytes
against what the runtime runs and keeps, and a mixture of experts training in FP8 as in
bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import metrics, tiny_overrides
from tests.test_fp8 import E4M3, _bound
from threefold.config import ModelConfig, load_config
from threefold.layout import Workload
from threefold.model.experts import Experts
from threefold.parallel.transforms.fp8_blockwise import (TILE, block_scales, blockwise_linear,
                                                          cast_blocks, dequantise, quantise_tiles)
from threefold.parallel.transforms.fp8_experts import (Float8Experts, _grouped_rowwise_dx,
                                                        apply_fp8_experts, grouped_fp8_unfit,
                                                        grouped_rowwise)
from threefold.parallel.transforms.fp8_linear import apply_fp8, fp8_linear

RECIPES = ("tensorwise", "rowwise", "blockwise")


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread (torch._scaled_mm's CPU kernel spins its threads: tests/test_fp8.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _grads(fn, *inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def test_blockwise_is_exact_where_its_casts_lose_nothing():
    """Small integers times a power of 2 per tile (each tile's amax its own, so a scale put on
    the wrong tile would show) are e4m3 values after scaling, and every sum of their products
    is exact in fp32: the recipe then equals the fp32 matmul bit for bit, forward and both
    gradients, with a ragged last tile (K 320, N 200, 72 tokens)."""
    gen = torch.Generator().manual_seed(0)

    def exact(rows, cols):  # integers in [-8, 8] times 2^-2..2^2 by 64-row and 128-column tile
        ints = torch.randint(-8, 9, (rows, cols), generator=gen).float()
        r = 2.0 ** (torch.arange(rows) // 64 % 3 - 1)[:, None]
        c = 2.0 ** (torch.arange(cols) // TILE % 3 - 1)[None, :]
        return ints * r * c

    x, w, dy = exact(72, 320), exact(200, 320), exact(72, 200)
    got = _grads(lambda a, b: blockwise_linear(a, b, torch.float32), x, w, dy=dy)
    want = [x @ w.T, dy @ w, dy.T @ x]
    for name, g, r in zip(("y", "dx", "dW"), got, want):
        assert torch.equal(g, r), name


def test_blockwise_against_its_dequantised_matmul_and_fp64():
    """Random data: the output is the matmul of the dequantised tiles and blocks (to fp32
    summation order), within e4m3's rounding bound of the float64 product; with one outlier
    input feature, blockwise's error stays that of its tiles, where rowwise and tensorwise
    lose the small features' precision (scaled down into e4m3's subnormals)."""
    torch.manual_seed(0)
    x = torch.randn(64, 512)
    x[:, 5] *= 1e5  # an outlier feature: it sets every row's amax (and its tile's only)
    w = torch.randn(256, 512) * 0.05
    w[:, :TILE] = 0.0  # the outlier's tile adds no error: what is left is the other tiles'
    y = blockwise_linear(x, w, torch.float32)
    x8, sx = quantise_tiles(x)
    sw = block_scales(w)
    assert sx.shape == (64, 4) and sw.shape == (2, 4)
    assert torch.equal(torch.exp2(torch.log2(sx).round()), sx)  # powers of 2
    ref = dequantise(x8, sx, 1) @ dequantise(cast_blocks(w, sw), sw, TILE).T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = x.double() @ w.double().T
    err = (y.double() - exact).abs()
    bound = _bound(x, w.T, E4M3[0], E4M3[0], E4M3[1] * x.abs().max().item(),
                   E4M3[1] * w.abs().max().item())
    assert (err <= bound).all()
    full = {r: (fp8_linear(x, w, None, r).double() - exact).abs().mean().item() for r in RECIPES}
    assert full["blockwise"] < 0.5 * min(full["rowwise"], full["tensorwise"]), full
    calm = x.clone()
    calm[:, 5] /= 1e5  # blockwise: the other tiles never saw the outlier
    assert torch.equal(blockwise_linear(calm, w, torch.float32), y)


def _experts(e: int, h: int, f: int, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    cfg = ModelConfig(preset="tiny-moe", vocab_size=256, hidden_size=h, intermediate_size=f,
                      num_local_experts=e).resolved()
    m = Experts(cfg)
    nn.init.normal_(m.gate_up_proj, std=0.05)
    nn.init.normal_(m.down_proj, std=0.05)
    return m


def _holder(experts: Experts) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"experts": experts})])
    return model


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_expert_runs_as_an_fp8_layer_of_its_own(recipe):
    """The per-expert fallback (the CPU's) is each expert's FP8 linear layer, bit for bit,
    forward and gradients (an expert with no rows gets a zero gradient); for rowwise also
    the dequantised matmul itself (CPU's _scaled_mm dequantises first), exactly."""
    h, f, counts = 64, 96, [11, 0, 17, 4]
    plain = _experts(4, h, f)
    fp8 = _experts(4, h, f)
    assert apply_fp8_experts(_holder(fp8), recipe) == [] and isinstance(fp8, Float8Experts)
    assert f"fp8 {recipe}" in repr(fp8)
    rows = torch.randn(sum(counts), h, requires_grad=True)
    y = fp8.compute(rows, counts)
    dy = torch.randn_like(y)
    y.backward(dy)
    r2 = rows.detach().clone().requires_grad_()
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = fp8_linear(r2[start:start + n], plain.gate_up_proj[e], None,
                                  recipe).chunk(2, -1)
            outs.append(fp8_linear(torch.nn.functional.silu(gate) * up, plain.down_proj[e],
                                   None, recipe))
            start += n
    torch.cat(outs).backward(dy)
    assert torch.equal(y, torch.cat(outs).detach())
    assert torch.equal(rows.grad, r2.grad)
    assert torch.equal(fp8.gate_up_proj.grad, plain.gate_up_proj.grad)
    assert torch.equal(fp8.down_proj.grad, plain.down_proj.grad)
    assert not fp8.down_proj.grad[1].any() and fp8.down_proj.grad[0].any()
    if recipe == "rowwise":  # y_0's first product against the dequantised operands
        x = rows.detach()[:11]
        w = fp8.gate_up_proj.detach()[0]
        sx = torch.exp2(torch.floor(torch.log2(448 / x.abs().amax(1, keepdim=True))))
        sw = torch.exp2(torch.floor(torch.log2(448 / w.abs().amax(1, keepdim=True))))
        deq = lambda t, s: (t * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s  # noqa
        got = fp8_linear(x, w, None, "rowwise")
        assert torch.equal(got, deq(x, sx) @ deq(w, sw).T)
        assert not torch.equal(got, x @ w.T)


def test_the_grouped_fp8_kernel_is_chosen_by_device_and_its_arguments_pass_torchs_checks():
    """Where ``torch._scaled_grouped_mm`` runs (rowwise, bf16, CUDA 9.x/10.x, widths of 16),
    and its forward and input-gradient calls through torch's meta checks (shapes, strides,
    scale layouts, dtypes; the CPU build has no kernel)."""
    cuda = torch.device("cuda")
    assert grouped_fp8_unfit(cuda, "rowwise", torch.bfloat16, 128, 256, (9, 0)) is None
    assert grouped_fp8_unfit(cuda, "rowwise", torch.bfloat16, 128, 256, (10, 0)) is None
    for args, why in [((cuda, "rowwise", torch.bfloat16, 128, 256, (8, 0)), "capability 8.x"),
                      ((cuda, "tensorwise", torch.bfloat16, 128, 256, (9, 0)), "rowwise"),
                      ((cuda, "rowwise", torch.float32, 128, 256, (9, 0)), "writes bf16"),
                      ((cuda, "rowwise", torch.bfloat16, 128, 344, (9, 0)), "multiples of 16"),
                      ((torch.device("cpu"), "rowwise", torch.bfloat16, 128, 256), "CUDA only")]:
        assert why in grouped_fp8_unfit(*args), args
    e, t, h, n = 4, 96, 128, 256
    offs = torch.empty(e, dtype=torch.int32, device="meta")
    w = torch.empty(e, n, h, device="meta")
    y = grouped_rowwise(torch.empty(t, h, device="meta", dtype=torch.bfloat16), w, offs,
                        torch.bfloat16)
    assert y.shape == (t, n) and y.dtype == torch.bfloat16
    dx = _grouped_rowwise_dx(torch.empty(t, n, device="meta", dtype=torch.bfloat16), w, offs,
                             torch.float32)
    assert dx.shape == (t, h) and dx.dtype == torch.float32


def _moe_cfg(**kw):
    """A MoE block whose widths all meet FP8's rule (16) and span two 128 tiles."""
    base = dict(preset="tiny-moe", vocab_size=256, hidden_size=256, intermediate_size=128,
                num_hidden_layers=2, shared_expert_intermediate_size=0)
    return ModelConfig(**{**base, **kw}).resolved()


class _ScaledFlops(TorchDispatchMode):
    """Forward FLOPs of the FP8 matmuls (``aten._scaled_mm``: 2·M·K·N each)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            (m, k), n = args[0].shape, args[1].shape[1]
            self.flops += 2 * m * k * n
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_planners_fp8_share_is_what_the_runtime_multiplies_in_fp8(recipe):
    """A forward of a MoE model with a dense first block and a shared expert: the FLOPs of
    every scaled matmul the runtime executes equal the planner's FP8 share of the forward
    FLOPs, routed experts included (their rows total N·k however the router splits them)."""
    from threefold.accounting import flops_per_token
    from threefold.model.decoder import CausalLM
    from threefold.plan.compute import fp8_flops_fraction

    cfg = _moe_cfg(first_k_dense_replace=1, dense_intermediate_size=512,
                   shared_expert_intermediate_size=64)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    assert apply_fp8(model, recipe) == [] and apply_fp8_experts(model, recipe) == []
    b, s = 2, 32
    with torch.no_grad(), _ScaledFlops() as counted:
        model(torch.randint(0, 256, (b, s)))
    work = Workload(seq_len=s, global_batch=b, fp8=recipe)
    share = fp8_flops_fraction(cfg, work)
    assert counted.flops == pytest.approx(share * flops_per_token(cfg, s) / 3 * b * s, rel=1e-12)
    assert 0.5 < share < 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_moe_blocks_fp8_saved_bytes_are_the_planners(recipe):
    """What FP8 adds to a MoE block's saved tensors (fp32: no autocast copies) is the
    planner's ``fp8_scale_bytes``: tensorwise two scalars per projection and per expert and
    grouped product, blockwise one per 128×128 weight block, rowwise nothing."""
    from tests.test_tp_layer import SavedBytes
    from threefold.model.decoder import CausalLM
    from threefold.plan.activations import fp8_scale_bytes

    cfg = _moe_cfg(intermediate_size=160)  # experts: 2f = 320 → 3 blocks, f → 2 blocks
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    saved = {}
    for r in ("none", recipe):
        torch.manual_seed(0)
        model = CausalLM(cfg)
        apply_fp8(model, r)
        apply_fp8_experts(model, r)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        with SavedBytes(list(model.parameters())) as got:
            model.model.layers[0](x, cos, sin, None)
        saved[r] = got.total
    want = fp8_scale_bytes(cfg, Workload(s, b, fp8=recipe))
    assert saved[recipe] - saved["none"] == want
    e = cfg.num_local_experts
    assert want == {"tensorwise": 8 * 4 + 16 * e, "rowwise": 0,
                    "blockwise": 4 * (2 * 2 + 1 * 2 + 1 * 2 + 2 * 2) + 4 * e * (3 * 2 + 2 * 2)
                    }[recipe]


def test_a_mixture_of_experts_trains_in_fp8_as_in_bf16(corpus, cache_dir, tmp_path, monkeypatch):
    """10 steps of a tiny MoE: blockwise's final loss within 3% of bf16's, and the run's
    experts are FP8 experts (``parallelize`` made them: each call counted). (Tensorwise and
    rowwise experts are each expert's FP8 layer bit for bit, above, and those layers train
    as bf16 does in tests/test_fp8.py.)"""
    from threefold.training.train import train

    calls = {"blockwise": 0}
    compute = Float8Experts.compute

    def counted(self, rows, counts):
        calls[self.recipe] += 1
        return compute(self, rows, counts)

    monkeypatch.setattr(Float8Experts, "compute", counted)

    def run(name, **extra):
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / name,
                                               model__preset="tiny-moe", train__steps=10,
                                               train__dtype="bfloat16", **extra))
        train(cfg)
        return [r["loss"] for r in metrics(tmp_path / name)]

    bf16 = run("bf16")
    assert calls == {"blockwise": 0}
    for recipe in ("blockwise",):
        got = run(recipe, train__fp8=recipe)
        assert calls[recipe] >= 10 * 2  # every step, both MoE blocks (and evaluation)
        assert got[-1] == pytest.approx(bf16[-1], rel=0.03), recipe
        assert got != bf16, recipe
    assert bf16[-1] < 0.9 * bf16[0]  # it learned


def test_plan_and_dry_run_agree_on_blockwise_for_a_mixture_of_experts(tmp_path, monkeypatch):
    """``threefold plan --fp8 blockwise`` and the dry run's ``train.fp8 blockwise`` on the dry
    run's own layout, for a MoE whose experts run in FP8: the same compute time saved, the
    same scale bytes added to the activations, and no note that the experts stay bf16."""
    from threefold.commands.plan_options import build_parser
    from threefold.commands.planning import _setup
    from threefold.launch.dryrun import predict
    from threefold.plan.memory import memory_per_rank
    from threefold.plan.step import predict_step

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    model = [("model.preset", "tiny-moe"), ("model.intermediate_size", "128")]
    dry = {r: predict(load_config(None, model + [
        ("data.vocab_size", "512"), ("train.dtype", "bfloat16"), ("train.fp8", r),
        ("train.output_dir", str(tmp_path))]), 1) for r in ("none", "blockwise")}
    assert not any("routed experts run in" in n for n in dry["blockwise"].notes)
    toml = tmp_path / "m.toml"
    toml.write_text('[model]\npreset = "tiny-moe"\nintermediate_size = 128\n'
                    '[data]\nvocab_size = 512\n')
    layout, work = dry["none"].layout, dry["none"].work
    plan = {r: _setup(build_parser().parse_args([
        "--model", str(toml), "--gpus", "1", "--seq-len", str(work.seq_len),
        "--global-batch-tokens", str(work.seq_len * work.global_batch), "--fp8", r]))
        for r in ("none", "blockwise")}
    mcfg, cluster = plan["none"][0], plan["none"][1]
    assert plan["blockwise"][2].fp8 == dry["blockwise"].work.fp8 == "blockwise"
    step = {r: predict_step(mcfg, layout, plan[r][2], cluster) for r in plan}
    saved = step["none"].compute_s - step["blockwise"].compute_s
    assert saved > 0
    assert saved == pytest.approx(dry["none"].step.compute_s - dry["blockwise"].step.compute_s,
                                  rel=1e-9)
    act = {r: memory_per_rank(mcfg, layout, plan[r][2]).activations for r in plan}
    dry_act = {r: dry[r].memory.activations for r in dry}
    assert act["blockwise"] - act["none"] == pytest.approx(
        dry_act["blockwise"] - dry_act["none"]) and act["blockwise"] > act["none"]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])  # (rowwise runs as tensorwise)
def test_selective_recompute_keeps_the_planners_bytes_under_fp8(monkeypatch, recipe):
    """A selective MoE block (bf16 autocast) whose projections and experts run in FP8 keeps
    its input and its matmuls' outputs (``_scaled_mm`` per expert, blockwise's one matmul),
    the planner's selective count to the byte, as without FP8: the quantisation is
    recomputed, no scale is kept."""
    from tests.test_plan_moe import _first_block_saved, _kept_bytes
    from threefold.layout import Layout
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms import recompute
    from threefold.plan.activations import model_layer_activation_bytes

    keeps = []
    init = recompute._Keep.__init__
    monkeypatch.setattr(recompute._Keep, "__init__",
                        lambda self, kept, modules=(): (keeps.append(kept),
                                                        init(self, kept, modules))[1])
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", vocab_size=512, num_local_experts=8,
                      num_experts_per_tok=2).resolved()  # h 256, f 688: FP8's rule met
    model = CausalLM(cfg)
    assert apply_fp8(model, recipe) == [] and apply_fp8_experts(model, recipe) == []
    recompute.apply_recompute(model, "selective")
    b, s, h = 2, 64, cfg.hidden_size
    saved, x = _first_block_saved(model, b, s, h, torch.bfloat16)
    rope = 2 * 4 * b * s * cfg.head_dim
    assert saved.total == 4 * b * s * h + rope and len(keeps) == 1
    got = saved.total + _kept_bytes(keeps[0], [x, *model.parameters()]) - rope
    work = Workload(seq_len=s, global_batch=b, precision="bf16", residual_bytes=4,
                    master_bytes=4, flash_attention=True, fp8=recipe)
    assert got == model_layer_activation_bytes(cfg, Layout(microbatch_size=b,
                                                            recompute="selective"), work)
    assert any(op is torch.ops.aten._scaled_mm.default for op, _, _ in keeps[0]) == \
        (recipe != "blockwise")
