"""What one rank of a replica group holds, as the replica groups' sum and heal need it
(``threefold.parallel.ft_replicas``).

Every group runs the same layout, so rank r of one group holds exactly the pieces rank r of
another holds: whole local tensors (data parallelism; a tp rank's slices), or ZeRO's flat
shards (stages 1-3: the shard of every unit, its AdamW moments). Both the cross-group sum and
the heal therefore go rank to rank on those local tensors, with no collective inside the group
to make them whole first. For the heal that is a requirement, not a saving: torchft picks each
rank's source group on its own, so the ranks of a serving group need not serve together.

The sum of the groups' local gradients is one big data-parallel group's gradient: each group's
is already summed over its own ranks (ZeRO: reduce-scattered, every stage, before
``finish_gradients`` returns) of a loss divided by the token count of every group's rows.
"""

from __future__ import annotations

import hashlib

import torch

from threefold.parallel.engines.zero import ZeroEngine


def _local(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, the tensor AdamW updates) of every piece this rank trains, in a fixed order."""
    if isinstance(engine, ZeroEngine):
        return [(u.name, u.shard) for u in engine.all_units]
    return [(n, engine._trained(p)) for n, p in engine.named_params]


def rank_gradients(engine) -> list[torch.Tensor]:
    """This rank's reduced gradients, after ``finish_gradients``, to be summed in place with
    the same rank's of the other groups: ZeRO's shard gradients, else each trained tensor's."""
    if not isinstance(engine, ZeroEngine):
        return [engine.gradient_of(p) for _, p in engine.named_params]
    out = []
    for unit in engine.all_units:
        if unit.shard.grad is None:
            unit.shard.grad = torch.zeros_like(unit.shard)
        if engine.slot.offload is not None:  # sent to the host already: it changes now
            engine.slot.offload.forget(unit.shard)
        out.append(unit.shard.grad)
    return out


def rank_numels(engine) -> list[int]:
    """Sizes of ``rank_gradients``: what one rank sends across the groups per step."""
    return [t.numel() for _, t in _local(engine)]


def rank_state(engine) -> dict:
    """The state a group serves to heal the same rank of another: copies of this rank's
    trained tensors and AdamW moments (the transport serves them while training goes on)."""
    model, optim, step = {}, {}, 0
    for name, t in _local(engine):
        model[name] = t.detach().clone()
        st = engine.slot.state_of(t)
        if st:
            for key in ("exp_avg", "exp_avg_sq"):
                optim[f"{name}.{key}"] = st[key].detach().clone()
            step = int(st["step"])
    return {"model": model, "optim": optim, "optim_step": step}


@torch.no_grad()
def load_rank_state(engine, state: dict) -> None:
    """Install another group's ``rank_state`` of this rank; then the compute copies (ZeRO
    stages 1-2: the whole parameters, gathered inside this group, whose ranks all heal in the
    same quorum) are made again from it."""
    for name, t in _local(engine):
        t.data.copy_(state["model"][name])
        if f"{name}.exp_avg" in state["optim"]:
            engine.slot.set_state(t, state["optim_step"], state["optim"][f"{name}.exp_avg"],
                                  state["optim"][f"{name}.exp_avg_sq"])
    engine.slot.loaded_params()
    if not isinstance(engine, ZeroEngine):
        engine._refresh_compute_copies()
        return
    for unit in engine.all_units:
        if engine.stage < 3 or unit.gathered:
            unit.gathered = False
            unit.wait_gather()
        if engine.stage == 3:
            unit.release()


def rank_digest(engine) -> str:
    """SHA-256 of this rank's trained tensors' bytes, in order: equal on rank r of two groups
    exactly when they hold the same weights."""
    h = hashlib.sha256()
    for _, t in _local(engine):
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()
