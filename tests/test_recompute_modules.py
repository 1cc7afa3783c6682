"""Selective recompute's module policies (``train.recompute_modules``): what a block keeps
under each equals the planner's count to the byte (grouped-query, latent attention, a
mixture of experts), and every policy trains as no recompute, in one process and under
expert parallelism, sending no all-to-all row twice."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.dist import run_distributed
from tests.test_plan_moe import _kept_bytes
from tests.test_tp_layer import SavedBytes
from threefold.config import DEEPSEEK_RECOMPUTE, ModelConfig
from threefold.layout import Layout, Workload

LATENT = dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, num_key_value_heads=8, rope_interleave=True)
EXPERTS = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
               moe_router="sigmoid_grouped",
               n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
               shared_expert_intermediate_size=64, shared_expert_gate=False)
CASES = [  # (model, its fields, policies, dtype)
    ("gqa", {}, [(), ("core_attn",), ("layernorm", "mlp")], torch.float32),
    ("gqa", {}, [("core_attn", "mlp")], torch.bfloat16),
    ("latent", LATENT, [(), ("mlp",), DEEPSEEK_RECOMPUTE], torch.float32),
    ("latent-moe", {**LATENT, **EXPERTS}, [(), DEEPSEEK_RECOMPUTE, ("moe",), ("shared_experts",)],
     torch.float32),
    ("latent-moe", {**LATENT, **EXPERTS}, [DEEPSEEK_RECOMPUTE], torch.bfloat16),
    ("latent-moe-dense-first", {**LATENT, **EXPERTS, "first_k_dense_replace": 1,
                                "dense_intermediate_size": 96},
     [(), DEEPSEEK_RECOMPUTE, ("mlp",)], torch.float32),
]


def _kept(over: dict, modules: tuple, dtype) -> tuple[int, ModelConfig]:
    """Bytes block 0 keeps under selective recompute with ``modules``: what autograd saves
    (the checkpoint's input) and the distinct storages its ``_Keep`` tape holds, RoPE's
    tables (made once per microbatch) left out."""
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms import recompute

    tapes = []
    init = recompute._Keep.__init__

    def spy(self, kept, *more):
        tapes.append(kept)
        init(self, kept, *more)

    torch.manual_seed(0)
    cfg = ModelConfig(preset="tiny", vocab_size=256, num_hidden_layers=1, **over).resolved()
    model = CausalLM(cfg)
    recompute.apply_recompute(model, "selective", modules)
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
    auto = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else \
        contextlib.nullcontext()
    recompute._Keep.__init__ = spy
    try:
        with SavedBytes(list(model.parameters()) + [cos, sin]) as saved, auto:
            model.model.layers[0](x, cos, sin)
    finally:
        recompute._Keep.__init__ = init
    assert saved.total == x.nbytes  # autograd itself saves the checkpoint's input only
    return saved.total + _kept_bytes(tapes[0], [x, cos, sin, *model.parameters()]), cfg


@pytest.mark.parametrize("name,over,policies,dtype", CASES,
                         ids=[f"{c[0]}-{str(c[3])[6:]}" for c in CASES])
def test_each_policy_keeps_the_planners_bytes(name, over, policies, dtype):
    """For every policy the block keeps exactly ``model_layer_activation_bytes`` (CPU's
    fused attention needs v as wide as q, so latent attention's core runs materialised
    there: counted without flash attention; a mixture's dense first block as such);
    naming a module keeps less than the default."""
    from threefold.plan.activations import model_layer_activation_bytes

    d = 2 if dtype == torch.bfloat16 else 4
    default = None
    for modules in policies:
        got, cfg = _kept(over, modules, dtype)
        work = Workload(seq_len=32, global_batch=2, precision="bf16" if d == 2 else "fp32",
                        residual_bytes=4, master_bytes=4, flash_attention="latent" not in name)
        lay = Layout(microbatch_size=2, recompute="selective", recompute_modules=modules)
        want = model_layer_activation_bytes(cfg, lay, work, dense="dense" in name)
        assert got == want, (name, modules)
        default = got if not modules else default
        if default is not None and set(modules) - {"layernorm", "moe_act"}:
            assert got < default, modules


def _policies(rank: int, world: int) -> dict:
    """Per expert-parallel degree (1, then ``world``): loss, gradients and rows sent of a tiny
    DeepSeek-V3 (latent attention, a dense first block, grouped routing, a shared expert)
    under no recompute and each policy. Both degrees in one launch: one process set-up."""
    from threefold.comm.counted import Comm
    from threefold.comm.mesh import build_mesh
    from threefold.layout.axes import EXPERT_AXES

    cfg = ModelConfig(preset="tiny", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, first_k_dense_replace=1,
                      dense_intermediate_size=96, **{**LATENT, "num_key_value_heads": 4},
                      **{**EXPERTS, "intermediate_size": 32,
                         "shared_expert_intermediate_size": 32}).resolved()
    dims = Layout(dp_shard=world, ep=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    for axis in EXPERT_AXES:
        comm.add_axis(axis, dims.axis_groups(axis))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    return {ep: _each_policy(cfg, ids, comm if ep > 1 else None) for ep in (1, world)}


def _each_policy(cfg: ModelConfig, ids: torch.Tensor, comm) -> dict:
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.expert import apply_expert_parallel, take_rows_sent
    from threefold.parallel.transforms.recompute import apply_recompute

    out = {}
    for modules in (None, DEEPSEEK_RECOMPUTE, ("core_attn", "mlp", "moe"), ("shared_experts",)):
        torch.manual_seed(0)
        model = CausalLM(cfg)
        if comm is not None:
            apply_expert_parallel(model, comm)
        apply_recompute(model, "none" if modules is None else "selective", modules or ())
        loss = model.model(ids).pow(2).mean()
        loss.backward()
        out[modules] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                        take_rows_sent(model))
    return out


def test_every_policy_equals_no_recompute_in_one_process_and_under_ep2():
    """DeepSeek-V3's policy, a policy recomputing the attention core, the dense MLP and the
    whole mixture of experts, and one recomputing the shared expert give no recompute's loss
    and gradients (fp32, rel 1e-5), in one process and under ep 2; none sends a row the
    forward did not (the all-to-alls' results are kept under every policy)."""
    for per_ep in run_distributed(_policies, 2):
        for ep, out in per_ep.items():
            loss, grads, rows = out[None]
            for modules, (got, got_grads, got_rows) in out.items():
                torch.testing.assert_close(got, loss, rtol=1e-5, atol=0)
                for name, g in grads.items():
                    torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7,
                                               msg=f"ep {ep}, {modules}: {name}")
                assert got_rows == rows, (ep, modules)
            assert (rows > 0) == (ep > 1)


def test_the_planner_charges_the_named_modules_matmuls_again():
    """A named module's matmuls run again in backward: the planner's backward FLOPs grow by
    2 per weight per token of what the module multiplies by (the model's own q_b and kv_b
    for ``mla_up_proj``; the router, k experts and the shared expert for ``moe``), the
    attention core's for ``core_attn``; its search tries DeepSeek-V3's policy for latent
    attention, and ``threefold plan --recompute-modules`` names the policy it plans."""
    from threefold.model.decoder import CausalLM
    from threefold.plan.compute import stage_flops_per_microbatch
    from threefold.hardware.catalogue import get_hardware
    from threefold.plan.candidates import SearchSpace
    from threefold.plan.cluster import Cluster
    from threefold.plan.search import search

    cfg = ModelConfig(preset="tiny", vocab_size=256, num_hidden_layers=2, **LATENT,
                      **EXPERTS).resolved()
    block = CausalLM(cfg).model.layers[1]
    attn, moe = block.self_attn, block.mlp
    work = Workload(seq_len=64, global_batch=8, precision="bf16")
    tokens = 64 * 2

    def extra(mods):
        lay = Layout(microbatch_size=2, recompute="selective", recompute_modules=mods)
        base = dataclasses.replace(lay, recompute_modules=())
        return (stage_flops_per_microbatch(cfg, lay, work, 0)[1]
                - stage_flops_per_microbatch(cfg, base, work, 0)[1]) / (2 * tokens * 2)

    up = attn.q_b_proj.weight.numel() + attn.kv_b_proj.weight.numel()
    assert extra(("mla_up_proj",)) == up
    experts = moe.gate.weight.numel() + 2 * (moe.experts.gate_up_proj[0].numel()
                                             + moe.experts.down_proj[0].numel())
    shared = sum(p.numel() for p in moe.shared_experts.parameters())
    assert extra(("moe",)) == experts + shared and extra(("shared_experts",)) == shared
    assert extra(DEEPSEEK_RECOMPUTE) == up
    core = 4 * 64 * cfg.num_attention_heads * cfg.head_dim / 2  # (per weight's 2 FLOPs)
    assert extra(("core_attn",)) == core
    cluster = Cluster(get_hardware("h100"), 8, 8)
    res = search(cfg, cluster, work, SearchSpace(tp=(1,), pp=(1,), zero_stage=(1,),
                                                  microbatch_size=(1,), ep=(1,)))
    policies = {c.layout.recompute_modules for c in res.ranked
                if c.layout.recompute == "selective"}
    assert policies == {(), DEEPSEEK_RECOMPUTE}


def test_plan_takes_the_policy_it_prints(capsys):
    """``threefold plan --recompute`` takes a policy as its table and JSON print it
    (selective:a+b, modules in any order) and plans that policy only."""
    import json

    from threefold.commands.planning import main

    assert main(["--model", "tiny", "--gpus", "2", "--json", "--top", "8", "--tp", "1",
                 "--recompute", "selective:mlp+core_attn"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["recompute"] for r in rows} == {"selective:core_attn+mlp"}
    assert main(["--model", "tiny", "--gpus", "2", "--recompute", "full:mlp"]) == 2
    assert "only selective takes modules" in capsys.readouterr().err
