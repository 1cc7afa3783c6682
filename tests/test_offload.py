"""Optimiser offload (``parallel.offload_optimizer``, threefold.parallel.engines.offload): on this CPU
machine host and device are the same memory, so these tests prove the offloaded code path —
host fp32 masters and AdamW state, gradients copied down, parameters copied up — trains to the
same losses and weights as the on-device optimiser, for one process, data parallelism, ZeRO
1/2/3, a pipeline of two stages and ZeRO-3 × tp2; that the optimiser state is held apart from the
parameters; and that checkpoints move between the two."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.config import load_config
from threefold.training.train import train

STEPS = 3
HOST = torch.device("cpu")


def _state_apart(engine) -> dict:
    """Where ``engine``'s optimiser state lives: every state tensor on the host and none
    sharing storage with a parameter (or ZeRO shard) the device trains."""
    device_ptrs = {p.untyped_storage().data_ptr() for _, p in engine.named_params}
    if hasattr(engine, "all_units"):
        device_ptrs |= {u.shard.untyped_storage().data_ptr() for u in engine.all_units}
        device_ptrs |= {u.full.untyped_storage().data_ptr() for u in engine.all_units
                        if u.full.untyped_storage().size()}
    device_ptrs.discard(0)
    off = engine.slot.offload
    tensors = [t for st in engine.optimizer.state.values() for k, t in st.items() if k != "step"]
    tensors += list(off.masters) if off is not None else []
    return {"offloaded": off is not None,
            "on_host": all(t.device == HOST for t in tensors),
            "apart": not ({t.untyped_storage().data_ptr() for t in tensors} & device_ptrs),
            "state_tensors": len(tensors),
            "host_bytes": off.host_bytes() if off is not None else 0}


# The host optimiser runs torch's fused CPU AdamW (threefold.parallel.engines.adamw.HOST_KERNEL, the
# fastest on the host), the on-device engines the single-tensor kernel: the same formula,
# rounded differently in the last bits. So an offloaded run equals the on-device one to fp32
# tolerance, as the other equivalence tests compare (1e-5 relative on the losses).
LOSS_REL, W_RTOL, W_ATOL = 1e-5, 1e-4, 2e-5


def _check_same(a, b):
    la, lb = [r["loss"] for r in metrics(a)], [r["loss"] for r in metrics(b)]
    assert la == pytest.approx(lb, rel=LOSS_REL), (a.name, b.name)
    wa, wb = final_weights(a), final_weights(b)
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=W_RTOL, atol=W_ATOL, msg=f"{a.name}: {k}")


def test_offload_single_process_equals_on_device(corpus, cache_dir, tmp_path):
    outs = {}
    for off in ("false", "true"):
        out = outs[off] = tmp_path / f"offload_{off}"
        cfg = load_config(None, tiny_overrides(corpus, cache_dir, out, train__steps=STEPS,
                                               parallel__offload_optimizer=off))
        _, run = train(cfg, return_run=True)
        where = _state_apart(run.engine)
        assert where["offloaded"] == (off == "true")
        if off == "true":
            assert where["on_host"] and where["apart"] and where["state_tensors"] > 0
            # masters + gradient buffers (4 + 4 bytes) and two moments (8) per parameter
            n = sum(p.numel() for _, p in run.engine.named_params)
            assert where["host_bytes"] == 16 * n
            # the planner predicts exactly that host figure, and a device figure lower by
            # AdamW's two fp32 moments (8 bytes per parameter) and its step temporaries
            off_plan = _planned(cfg, run.model_cfg, 1)
            on_plan = _planned(load_config(None, tiny_overrides(corpus, cache_dir, out)),
                               run.model_cfg, 1)
            assert off_plan.host == where["host_bytes"] and on_plan.host == 0
            assert off_plan.optimizer == 0 and on_plan.optimizer == 8 * n
            assert on_plan.total - off_plan.total >= 8 * n
    _check_same(outs["true"], outs["false"])


def _pairs(rank, world, corpus, cache, root, runs):
    """Each rank: train every (name, overrides) run; report where the optimiser state is."""
    from threefold.parallel.distributed_world import Distributed

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        _, run = train(cfg, Distributed(cfg), return_run=True)
        out[name] = _state_apart(run.engine)
        out[name]["planned_host"] = _planned(cfg, run.model_cfg, world,
                                             getattr(run.world, "pp_rank", 0)).host
    return out


def _planned(cfg, mcfg, world, stage=0):
    """The planner's memory breakdown of this run's layout, for a rank of pipeline ``stage``."""
    from threefold.layout import Layout, Workload
    from threefold.plan.memory import stage_memory

    return stage_memory(mcfg, Layout.from_config(cfg, world), Workload.from_config(cfg), stage)


def _with_and_without(layouts):
    runs = []
    for name, extra in layouts:
        runs += [(name, extra), (name + "_offload", {**extra,
                                                     "parallel__offload_optimizer": "true"})]
    return runs


LAYOUTS_2 = [
    ("dp2", {}),
    ("zero1", {"parallel__zero_stage": 1}),
    ("zero2", {"parallel__zero_stage": 2}),
    ("zero3", {"parallel__zero_stage": 3, "train__micro_batch_size": 2}),
    ("pp2_zero1", {"parallel__pp": 2, "parallel__zero_stage": 1, "train__micro_batch_size": 2}),
]
LAYOUTS_4 = [("zero3_tp2", {"parallel__zero_stage": 3, "parallel__tp": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)],
                         ids=["2ranks", "4ranks"])
def test_offload_equals_on_device(world, layouts, corpus, cache_dir, tmp_path):
    results = run_distributed(_pairs, world, corpus, cache_dir, tmp_path,
                              _with_and_without(layouts), timeout=400)
    for name, _ in layouts:
        _check_same(tmp_path / f"{name}_offload", tmp_path / name)
        for r in results:
            on, off = r[name], r[f"{name}_offload"]
            assert not on["offloaded"] and off["offloaded"], name
            assert off["on_host"] and off["apart"], name
            assert off["state_tensors"] > on["state_tensors"] > 0, name  # + the masters
            assert off["host_bytes"] == off["planned_host"] > 0 and on["planned_host"] == 0


@pytest.mark.slow
def test_offload_checkpoint_resumes_either_way(corpus, cache_dir, tmp_path):
    """A ZeRO-2 run that saves at step 2 with offload resumes without it, and one saved
    without resumes with it; both end where an uninterrupted run ends."""
    from threefold.weights.checkpoint import load_checkpoint

    runs = {"ref": [(None, 4)], "off_then_on": [("true", 2), ("false", 4)],
            "on_then_off": [("false", 2), ("true", 4)]}
    for name, segments in runs.items():
        for off, steps in segments:
            extra = {"parallel__zero_stage": 2}
            if off:
                extra["parallel__offload_optimizer"] = off
            run_distributed(_resume_segment, 2, corpus, cache_dir, tmp_path / name, extra,
                            steps, timeout=300)
    for name in ("off_then_on", "on_then_off"):
        _check_same(tmp_path / name, tmp_path / "ref")
        a, _ = load_checkpoint(tmp_path / name / "checkpoints" / "4")
        b, _ = load_checkpoint(tmp_path / "ref" / "checkpoints" / "4")
        assert set(a["optim"]) == set(b["optim"]) and a["optim"]
        for k in a["optim"]:  # fp32 tolerance (the host kernel's rounding), scaled per tensor
            ref = b["optim"][k]
            torch.testing.assert_close(a["optim"][k], ref, rtol=W_RTOL,
                                       atol=1e-5 * float(ref.abs().max()), msg=k)


def _resume_segment(rank, world, corpus, cache, out, extra, steps):
    from threefold.parallel.distributed_world import Distributed

    cfg = load_config(None, tiny_overrides(corpus, cache, out, train__steps=steps,
                                           checkpoint__interval=2, checkpoint__resume="true",
                                           **extra))
    train(cfg, Distributed(cfg))


def _overlap_run(rank, world, stage, micro):
    """One ZeRO step of a 4-block model on ``micro`` micro-batches, with and without offload.
    Returns the offloaded engine's events in order — ("micro", last) at each micro-batch's
    start, ("bwd", unit) at each unit's backward start, ("d2h", unit) at each early gradient
    copy — and the largest relative difference of the shards after the step."""
    from threefold.comm.counted import Comm
    from threefold.config import ModelConfig, OptimConfig
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.model.decoder import CausalLM, causal_lm_loss
    from threefold.parallel.engines.zero import ZeroEngine

    dims = Layout(dp_shard=world, tp=1)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    mcfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2).resolved(320)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 320, (2 * micro, 17), generator=g)
    engines, events = {}, []
    for off in (False, True):
        model = CausalLM(mcfg)
        model.init_weights(0)
        units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
        eng = engines[off] = ZeroEngine(model, units, OptimConfig(), comm, stage, offload=off)
        if off:
            eng.slot.offload.events = events
            for i, (module, _) in enumerate(eng.unit_modules):
                module.register_full_backward_pre_hook(
                    lambda _m, _g, i=i: events.append(("bwd", i)))
        for k in range(micro):
            if off:
                events.append(("micro", k == micro - 1))
            with eng.micro_step(last=k == micro - 1):
                x = ids[2 * k:2 * k + 2]
                causal_lm_loss(model(x[:, :-1]), x[:, 1:], reduction="mean").backward()
        eng.finish_gradients()
        eng.clip_grad_norm(0.5)
        eng.step(1e-2)
    diff = max(float(((a.shard - b.shard).abs() / b.shard.abs().clamp(min=1e-3)).max().detach())
               for a, b in zip(engines[True].all_units, engines[False].all_units))
    return {"events": events, "units": len(engines[True].all_units), "diff": diff}


@pytest.mark.parametrize("stage,micro", [(2, 1), (2, 2), (3, 2)])
def test_offload_copies_overlap_backward(stage, micro):
    """Under ZeRO 2 and 3 a unit's gradient copy to the host is issued once its last
    reduce-scatter of the step finished, before the backward of the units ahead of it is over:
    the LM head's copy comes before the embedding's backward starts. No copy is issued on an
    accumulation micro-step (the gradient is not final), every unit is copied at most once
    early, and the step (clipped, the clip scaling host copies) matches the on-device one."""
    for r in run_distributed(_overlap_run, 2, stage, micro, timeout=120):
        ev = r["events"]
        last_micro = ev.index(("micro", True))
        assert all(e[0] != "d2h" for e in ev[:last_micro])
        sent = [e[1] for e in ev if e[0] == "d2h"]
        assert len(sent) == len(set(sent)) and sent, sent
        head, embed_bwd = r["units"] - 1, ev.index(("bwd", 0), last_micro)
        assert ev.index(("d2h", head)) < embed_bwd, ev
        assert sum(e[0] == "d2h" for e in ev[:embed_bwd]) >= r["units"] - 3, ev
        assert r["diff"] < 1e-5


def test_bench_offload_tiny(capsys):
    """bench/bench_offload.py runs end to end at a tiny size and prints its two JSON lines."""
    import json

    from bench.bench_offload import main

    assert main(["--preset", "tiny", "--rounds", "1", "--seq-len", "16", "--batch", "1",
                 "--no-deepspeed"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["benchmark"] for x in lines] == ["offload_host_adamw", "offload_step"]
    assert lines[0]["single_over_fused_median"] > 0 and lines[1]["speed_ratio_median"] > 0
