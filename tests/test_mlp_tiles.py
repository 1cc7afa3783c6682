"""The tiled MLP (``train.mlp_tiles``): the same output and gradients as the untiled MLP
(fp32), and what a block then keeps for backward is, to the byte, what the planner and the
dry run count (``threefold.plan.mlp_tiling``); its refusals are the rule book's."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.test_dryrun import _Loopback
from tests.test_tp_layer import SavedBytes
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload
from threefold.model.decoder import CausalLM
from threefold.parallel.transforms.mlp_tiles import TiledMLP, apply_mlp_tiles
from threefold.plan.activations import model_layer_activation_bytes, recompute_working_bytes
from threefold.plan.mlp_tiling import tiled_mlp_bytes, tiled_mlp_weights

TILES = 4


def _model(tiles: int, tp: int = 1, sp: bool = False, **extra) -> CausalLM:
    from threefold.parallel.transforms.tensor import apply_tensor_parallel

    cfg = ModelConfig(preset="tiny", vocab_size=512, **extra).resolved()
    model = CausalLM(cfg)
    model.init_weights(seed=3)
    apply_mlp_tiles(model, tiles)  # before tensor parallelism, as parallelize does
    if tp > 1:
        apply_tensor_parallel(model, _Loopback(tp), sp)
    return model


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tiled_mlp_equals_the_untiled_one(recompute):
    """Loss and every gradient of a 1-block model, tiled (uneven tiles: 64 tokens in 5) and
    not, fp32; under full recompute the tiles' checkpoints nest in the block's."""
    from threefold.parallel.transforms.recompute import apply_recompute

    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    grads, losses = [], []
    for tiles in (1, 5):
        model = _model(tiles, num_hidden_layers=1)
        apply_recompute(model, recompute)
        assert any(isinstance(m, TiledMLP) for m in model.modules()) == (tiles > 1)
        loss = model(ids, labels=ids).mean()  # per-token losses
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=n)


def _saved(model, tp, sp, dtype, b=2, s=64):
    layer = model.model.layers[0]
    h = layer.post_attention_layernorm.weight.shape[0]
    x = torch.randn(b, s // tp if sp else s, h, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    with SavedBytes(list(model.parameters())) as saved, auto:
        layer(x, cos, sin)
    return saved.total


@pytest.mark.parametrize("tp,sp,dtype,act", [(1, False, torch.float32, "silu"),
                                             (2, True, torch.float32, "silu"),
                                             (1, False, torch.bfloat16, "silu"),
                                             (1, False, torch.float32, "gelu_tanh")])
def test_tiled_block_keeps_what_the_planner_counts(tp, sp, dtype, act):
    extra = {"hidden_act": act} if act != "silu" else {}
    b, s = 2, 64
    untiled, tiled = (_saved(_model(t, tp, sp, **extra), tp, sp, dtype, b, s) for t in (1, TILES))
    cfg = ModelConfig(preset="tiny", vocab_size=512, **extra).resolved()
    lay = Layout(tp=tp, sequence_parallel=sp, microbatch_size=b)
    prec = "bf16" if dtype == torch.bfloat16 else "fp32"
    work = Workload(s, b, precision=prec, residual_bytes=4, mlp_tiles=TILES)
    untiled_w = dataclasses.replace(work, mlp_tiles=1)
    casts = 0  # autocast's weight copies (the planner's cast_weight_bytes, apart)
    if dtype == torch.bfloat16:
        casts = -2 * (tiled_mlp_weights(cfg, lay, work) - tiled_mlp_weights(cfg, lay, untiled_w))
    assert tiled - untiled == tiled_mlp_bytes(cfg, lay, work) + casts < 0
    assert model_layer_activation_bytes(cfg, lay, work) == \
        model_layer_activation_bytes(cfg, lay, untiled_w) + tiled_mlp_bytes(cfg, lay, work)
    full = dataclasses.replace(lay, recompute="full")  # the block being recomputed: tiled
    assert recompute_working_bytes(cfg, full, work) < recompute_working_bytes(cfg, full, untiled_w)


def test_tiled_lora_adapters_keep_what_the_planner_counts():
    """LoRA on every projection: a tiled MLP's adapters recompute their x·Aᵀ with it, and
    the planner's adapter count leaves them out (fp32)."""
    from threefold.config import LoRAConfig
    from threefold.config.validation import lora_targets
    from threefold.model.lora import apply_lora
    from threefold.plan.activations import adapter_activation_bytes

    cfg = ModelConfig(preset="tiny", vocab_size=512).resolved()
    lora = LoRAConfig(r=4, target_modules="all-linear")
    b, s = 2, 64
    for tiles in (1, TILES):
        model = CausalLM(cfg)
        apply_mlp_tiles(apply_lora(model, lora), tiles)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
        with SavedBytes(list(model.parameters()) + [cos, sin]) as saved:
            model.model.layers[0](x, cos, sin)
        work = Workload(s, b, precision="fp32", residual_bytes=4, mlp_tiles=tiles, lora_r=4,
                        lora_targets=lora_targets(lora))
        lay = Layout(microbatch_size=b)
        assert saved.total == model_layer_activation_bytes(cfg, lay, work) + \
            adapter_activation_bytes(lay, work)
