"""The grouped experts (``model.moe_impl grouped``: ``torch._grouped_mm`` over the rows sorted
by expert) against the loop over experts, the reference: values and every gradient agree in
fp32 within 1e-5, for Mixtral's softmax routing, DeepSeek's grouped sigmoid routing with a
shared expert, an expert no token picks, and widths that send the grouped impl back to the
loop (``grouped_mm_unfit``, tested directly for the device-dependent part)."""

from __future__ import annotations

import copy

import pytest
import torch

from threefold.config import ConfigError, ModelConfig, load_config
from threefold.model.experts import Experts, grouped_mm_unfit
from threefold.model.moe import SparseMoeBlock

TOL = 1e-5


def _graph_ops(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``: which impl actually ran."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def _pair(module: torch.nn.Module, seed: int = 0):
    """The module with normal(0, 0.02) weights as grouped, and a copy as loop."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    loop = copy.deepcopy(module)
    for m in (module, loop):
        for e in m.modules():
            if isinstance(e, Experts):
                e.impl = "grouped" if m is module else "loop"
    return module, loop


def _run(module, inputs, loss):
    """Forward, ``loss(y)`` backward; (y, input grads, {name: param grad})."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    for p in module.parameters():
        p.grad = None
    y = module(*xs)
    loss(y).backward()
    return y, [x.grad for x in xs if x.requires_grad], \
        {n: p.grad for n, p in module.named_parameters()}


def _assert_same(grouped, loop, inputs, loss=lambda y: y.sum()):
    """Values and every gradient of the two within TOL; the grouped one ran _grouped_mm."""
    yg, dg, pg = _run(grouped, inputs, loss)
    yl, dl, pl = _run(loop, inputs, loss)
    assert any("GroupedMm" in n for n in _graph_ops(yg)), _graph_ops(yg)
    assert not any("GroupedMm" in n for n in _graph_ops(yl))
    torch.testing.assert_close(yg, yl, rtol=TOL, atol=TOL)
    for a, b in zip(dg, dl):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    assert pg.keys() == pl.keys()
    for name in pg:
        assert pg[name] is not None, name
        torch.testing.assert_close(pg[name], pl[name], rtol=TOL, atol=TOL, msg=name)
    return pg


def test_grouped_equals_loop_softmax_and_sigmoid_grouped_with_shared_expert():
    """Mixtral-style (tiny-moe: h 256, 8 experts of f 344, top-2, softmax) with a plain sum
    as the loss (whose gradient has stride 0: what _grouped_mm's backward refuses unmended),
    and DeepSeek-style (sigmoid scores, 4 groups keep 2, routed scaling, an ungated shared
    expert) with a weighted loss."""
    torch.manual_seed(0)
    mix = ModelConfig(preset="tiny-moe", vocab_size=512).resolved()
    assert mix.moe_impl == "grouped"  # the default
    x = torch.randn(2, 24, mix.hidden_size)
    _assert_same(*_pair(SparseMoeBlock(mix)), [x])

    ds = ModelConfig(preset="tiny-moe", vocab_size=512, moe_router="sigmoid_grouped",
                     n_group=4, topk_group=2, routed_scaling_factor=2.5, num_experts_per_tok=3,
                     shared_expert_intermediate_size=128, shared_expert_gate=False).resolved()
    grouped, loop = _pair(SparseMoeBlock(ds), seed=1)
    assert grouped.shared_experts is not None and grouped.grouped
    w = torch.randn(2, 24, ds.hidden_size)
    _assert_same(grouped, loop, [x], loss=lambda y: (y * w).sum())


def test_an_expert_without_tokens_gets_a_zero_gradient_in_both():
    """Experts 1 and 3 of 4 get no rows (the offsets repeat): their gradient slices are zero
    on both sides, the others equal."""
    cfg = ModelConfig(preset="tiny-moe", vocab_size=512, num_local_experts=4).resolved()
    grouped, loop = _pair(Experts(cfg))
    n, k = 10, 2
    experts = torch.tensor([[0, 2]] * 6 + [[2, 0]] * 4)
    weights = torch.rand(n, k)
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    assert counts.tolist() == [10, 0, 10, 0]
    x = torch.randn(n, cfg.hidden_size)
    grads = _assert_same(grouped, loop, [x, experts, weights, counts])
    for name in ("gate_up_proj", "down_proj"):
        assert grads[name][[1, 3]].abs().max() == 0
        assert grads[name][[0, 2]].abs().max() > 0


def test_widths_off_the_16_byte_rule_fall_back_to_the_loop():
    """h 30 and f 42 are no multiples of 4 (fp32 rows of 16-byte strides): the grouped impl
    runs the loop, with the loop's numbers."""
    cfg = ModelConfig(preset="tiny-moe", vocab_size=512, hidden_size=30, intermediate_size=42,
                      num_attention_heads=2, num_key_value_heads=1).resolved()
    assert grouped_mm_unfit(torch.device("cpu"), torch.float32, 30, 42) is not None
    grouped, loop = _pair(SparseMoeBlock(cfg))
    x = torch.randn(1, 16, 30)
    yg, _, pg = _run(grouped, [x], lambda y: y.sum())
    yl, _, pl = _run(loop, [x], lambda y: y.sum())
    assert not any("GroupedMm" in n for n in _graph_ops(yg))
    assert torch.equal(yg, yl) and all(torch.equal(pg[n], pl[n]) for n in pg)


def test_grouped_mm_rule():
    """The rule by dtype, widths and device (CUDA's part without a GPU: the capability is
    passed in)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert grouped_mm_unfit(cpu, torch.float32, 256, 344) is None
    assert grouped_mm_unfit(cpu, torch.bfloat16, 256, 344) is None  # 344 = 8 * 43
    assert "multiples of 8" in grouped_mm_unfit(cpu, torch.bfloat16, 256, 340)
    assert "multiples of 4" in grouped_mm_unfit(cpu, torch.float32, 254, 344)
    assert "dtype" in grouped_mm_unfit(cpu, torch.float64, 256, 344)
    assert grouped_mm_unfit(cuda, torch.bfloat16, 4096, 14336, capability=(9, 0)) is None
    assert grouped_mm_unfit(cuda, torch.bfloat16, 4096, 14336, capability=(10, 0)) is None
    assert "capability 8" in grouped_mm_unfit(cuda, torch.bfloat16, 4096, 14336, (8, 0))
    assert "bf16 only" in grouped_mm_unfit(cuda, torch.float32, 4096, 14336, (9, 0))
    # traced by torch.compile, the op's meta function holds every device to CUDA's bf16 rule
    assert "compile" in grouped_mm_unfit(cpu, torch.float32, 256, 344, compiling=True)
    assert grouped_mm_unfit(cpu, torch.bfloat16, 256, 344, compiling=True) is None


def test_bf16_autocast_grouped_matches_loop():
    """Under bf16 autocast the grouped impl casts rows and weights as F.linear does: the
    outputs agree to bf16 rounding."""
    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny-moe", vocab_size=512).resolved()
    grouped, loop = _pair(SparseMoeBlock(cfg))
    x = torch.randn(1, 16, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yg, yl = grouped(x), loop(x)
    assert yg.dtype == yl.dtype
    assert any("GroupedMm" in n for n in _graph_ops(yg))
    torch.testing.assert_close(yg.float(), yl.float(), rtol=2e-2, atol=2e-3)


def test_moe_impl_is_validated_by_name():
    with pytest.raises(ConfigError, match="model.moe_impl"):
        load_config(None, [("model.moe_impl", "bogus")])
    assert load_config(None, [("model.moe_impl", "loop")]).model.moe_impl == "loop"


def test_grouped_keeps_its_offsets_more_as_the_planner_counts():
    """What autograd saves for one MoE block: the grouped impl keeps the loop's tensors plus
    its int32 offsets (4 bytes per expert), and the planner's block bytes differ by that."""
    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Layout, Workload
    from threefold.plan.moe_memory import moe_block_extra_bytes

    cfg = ModelConfig(preset="tiny-moe", vocab_size=512).resolved()
    grouped, loop = _pair(SparseMoeBlock(cfg))
    x = torch.randn(2, 32, cfg.hidden_size, requires_grad=True)
    saved = {}
    for name, block in (("grouped", grouped), ("loop", loop)):
        with SavedBytes(list(block.parameters())) as s:
            block(x)
        saved[name] = s.total
    e = cfg.num_local_experts
    assert saved["grouped"] - saved["loop"] == 4 * e
    work = Workload(seq_len=32, global_batch=2, precision="fp32", backend_copies=True,
                    eager=True)
    lay = Layout(microbatch_size=2)
    loop_cfg = ModelConfig(preset="tiny-moe", vocab_size=512, moe_impl="loop").resolved()
    assert moe_block_extra_bytes(cfg, lay, work) - moe_block_extra_bytes(loop_cfg, lay, work) \
        == 4 * e
    # compiled (eager False), fp32 experts loop: the planner counts no offsets
    compiled = Workload(seq_len=32, global_batch=2, precision="fp32", backend_copies=True)
    assert moe_block_extra_bytes(cfg, lay, compiled) == moe_block_extra_bytes(loop_cfg, lay,
                                                                              compiled)
