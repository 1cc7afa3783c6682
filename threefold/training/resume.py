"""A run's checkpoints: what a step's state is made of (``save``), and continuing from the
newest committed one (``resume``), each rank reading only the regions it holds."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from threefold.weights.checkpoint_verify import (CheckpointError, NodeGroup, committed_steps,
    resolve_root)
from threefold.weights.checkpoint import save_sharded, unwritable
from threefold.weights.checkpoint_async import AsyncSaver
from threefold.weights.checkpoint_memory import memory_ladder, memory_root
from threefold.config import ConfigError
from threefold.parallel.materialize import load_buffers
from threefold.training.steps import lr_at
from threefold.weights import open_sharded

if TYPE_CHECKING:  # annotations only
    from threefold.training.run import Run

_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def node_group(lay) -> NodeGroup:
    """Which node every rank of layout ``lay`` is on (torchrun's GROUP_RANK; 0 without it)
    and its logging channel's collectives, for checkpoints on nodes that may share no
    filesystem (``threefold.weights.checkpoint.NodeGroup``); one process on one node without a
    channel. Collective the first time (an all-gather), then kept."""
    c = lay.control
    if c is None:
        return NodeGroup()
    if lay not in _GROUPS:
        node = int(os.environ.get("GROUP_RANK") or 0)
        _GROUPS[lay] = NodeGroup(c.all_gather_object(node), c.barrier, c.gather_object,
                                 c.all_gather_object, c.broadcast_object)
    return _GROUPS[lay]


def save(run: Run, step: int, saver: AsyncSaver | None = None, root: Path | None = None,
         keep_last: int | None = None) -> None:
    """Collective: every rank writes what it holds into its node's checkpoint root; rank 0
    adds the run's state and, once every node's part is in place, the global index. With
    ``saver`` (``checkpoint.async_save``) the files are written in the background from a host
    copy and the commit is ``saver.finish()``, which the caller runs at a point it fixes.
    ``root`` and ``keep_last``: another root than storage's (the in-memory checkpoints')."""
    lay = run.world
    group = node_group(lay)
    ckroot = root or resolve_root(run.cfg.checkpoint.dir, run.out, group.node_of[lay.rank])
    keep = keep_last or run.cfg.checkpoint.keep_last
    state = None
    if lay.is_writer:
        state = {"step": step, "optim_step": run.engine.optim_step(),
                 "sampler": run.sampler.state_dict(), "config": run.cfg.to_dict(),
                 "model_config": vars(run.model_cfg), "layout": lay.describe(),
                 "scheduler": {"last_step": step, "lr": lr_at(step - 1, run.cfg) if step else 0.0}}
    pieces, rng = lay.checkpoint_pieces(run.engine), {"cpu_rng": torch.get_rng_state()}
    with lay.phase(f"save {step}"):
        if saver is None:
            save_sharded(ckroot, step, lay.rank, lay.world_size, pieces, rng, state, keep,
                         lay.barrier, group)
        else:
            saver.start(ckroot, step, lay.rank, lay.world_size, pieces, rng, state, keep, group)
            if root is None:
                run.memory["async_save_copy_bytes"] = saver.copy_bytes


def finished_step(cfg, lay) -> int | None:
    """Collective: the step of the newest committed checkpoint when the run resumes and that
    step is at or past ``train.steps`` (a finished run: nothing to do), else None. Read before
    the run is built, so that a finished run loads no data, model or weights."""
    c = cfg.checkpoint
    if not (c.resume or lay.restarts):
        return None
    group = node_group(lay)
    steps = committed_steps(resolve_root(c.dir, cfg.train.output_dir, group.node_of[lay.rank]),
                            lay.rank, group)
    return steps[-1] if steps and steps[-1] >= cfg.train.steps else None


def resume(run: Run) -> int:
    """Load the newest committed checkpoint if asked; return the step to start from.
    Collective: every node's checkpoint root is checked (writable, when the run will save),
    rank 0's index decides the step, and each node's part must be on some node."""
    lay, c = run.world, run.cfg.checkpoint
    group = node_group(lay)
    ckroot = resolve_root(c.dir, run.out, group.node_of[lay.rank])
    field = "checkpoint.dir" if c.dir else "train.output_dir"
    why = unwritable(ckroot) if (c.interval or c.save_final) and group.is_leader(lay.rank) \
        else None
    for node, bad in zip(group.node_of, group.all_gather(why)):
        if bad:
            raise ConfigError(f"{field}: checkpoints of node {node} cannot be written: {bad}")
    steps = committed_steps(ckroot, lay.rank, group)
    # after a restart by torchrun (--max-restarts) the run always continues from its checkpoint
    if not (c.resume or lay.restarts):
        if steps:
            raise ConfigError(f"{field}: '{ckroot if c.dir else run.out}' already holds "
                              f"checkpoints (step {steps[-1]}); pass --checkpoint.resume true "
                              "to continue, or choose another --train.output_dir")
        return 0
    root, step, where = ckroot, steps[-1] if steps else 0, "storage"
    found = bool(steps)  # (an imported checkpoint is step 0: found, and loaded)
    if c.memory_interval:  # the ladder: memory (own or the peer's copy) before storage
        root = memory_root(c.memory_dir, run.out, group.node_of[lay.rank])
        step, where, notes = memory_ladder(root, lay.rank, group, step)
        root = ckroot if where == "storage" else root
        found = found or where != "storage"
        for note in notes if lay.is_writer else ():
            print(f"threefold: {note}", flush=True)
    if not found:
        return 0
    source, state, rng = open_sharded(root, step, lay.rank, group)
    if lay.is_writer:
        print(f"threefold: resumed step {step} from {where}", flush=True)
    saved = state["model_config"]
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if saved[key] != getattr(run.model_cfg, key):
            raise CheckpointError(f"checkpoint {step}: model.{key}={saved[key]} but this "
                                  f"run has {getattr(run.model_cfg, key)}")
    # each rank reads the regions it holds, whatever layout wrote them
    run.engine.load_from(source, state["optim_step"])
    load_buffers(run.engine.model, source)  # (DeepSeek's routing bias)
    run.memory["resume_bytes_read"] = source.bytes_read
    run.sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(rng["cpu_rng"])
    note = schedule_change(state, run.cfg)
    if note and lay.is_writer:
        print(f"threefold: {note}", flush=True)
    return int(state["step"])


def schedule_change(state: dict, cfg) -> str | None:
    """What a changed ``train.steps`` does to the learning rate on a resume (None when it is
    unchanged). The schedule (``steps.lr_at``) is a function of ``train.steps``: the resumed
    run follows the new length's warmup and cosine from the checkpoint's step on, as if it had
    been planned that long, so raising the steps of a finished run lifts the learning rate
    from where it had decayed to and decays it again to the new last step."""
    saved = state.get("config", {}).get("train", {}).get("steps", cfg.train.steps)
    step = int(state["step"])
    if saved == cfg.train.steps or not step:  # (an imported checkpoint has run no step)
        return None
    return (f"train.steps {saved} -> {cfg.train.steps}: the learning-rate schedule now spans "
            f"{cfg.train.steps} steps; step {step + 1} runs at lr {lr_at(step, cfg):.2e} "
            f"(step {step} ran at {state.get('scheduler', {}).get('lr', 0.0):.2e})")
