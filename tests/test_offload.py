"""Optimiser offload (``parallel.offload_optimizer``, threefold.parallel.offload): on this CPU
machine host and device are the same memory, so these tests prove the offloaded code path —
host fp32 masters and AdamW state, gradients copied down, parameters copied up — trains to the
same losses and weights as the on-device optimiser, for one process, data parallelism, ZeRO
1/2/3, a pipeline of two stages and ZeRO-3 × tp2; that the optimiser state is held apart from the parameters; and that
checkpoints move between the two."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.config import load_config
from threefold.train import train

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


def _check_same(a, b):
    la, lb = [r["loss"] for r in metrics(a)], [r["loss"] for r in metrics(b)]
    assert la == pytest.approx(lb, rel=1e-6), (a.name, b.name)
    wa, wb = final_weights(a), final_weights(b)
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=0, msg=f"{a.name}: {k}")


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
    from threefold.parallel.distributed_layout import Distributed

    out = {}
    for name, extra in runs:
        cfg = load_config(None, tiny_overrides(corpus, cache, root / name, train__steps=STEPS,
                                               **extra))
        _, run = train(cfg, Distributed(cfg), return_run=True)
        out[name] = _state_apart(run.engine)
        out[name]["planned_host"] = _planned(cfg, run.model_cfg, world,
                                             getattr(run.layout, "pp_rank", 0)).host
    return out


def _planned(cfg, mcfg, world, stage=0):
    """The planner's memory breakdown of this run's layout, for a rank of pipeline ``stage``."""
    from threefold.accounting import Layout, Workload
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
    from threefold.checkpoint import load_checkpoint

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
        for k in a["optim"]:
            torch.testing.assert_close(a["optim"][k], b["optim"][k], rtol=1e-6, atol=0, msg=k)


def _resume_segment(rank, world, corpus, cache, out, extra, steps):
    from threefold.parallel.distributed_layout import Distributed

    cfg = load_config(None, tiny_overrides(corpus, cache, out, train__steps=steps,
                                           checkpoint__interval=2, checkpoint__resume="true",
                                           **extra))
    train(cfg, Distributed(cfg))
