"""Fuzzed layouts: a seeded generator of random configurations (world size, every parallel
degree, schedule, microbatches, ZeRO stage, sequence and context parallelism, heads, layers,
batch sizes, sequence length). Each one is either refused by the one layout check before
launch, with a message that names a field, or accepted, and then the dry run predicts it and
one rank of it (chosen at random) trains a real step, checkpoint included, against torch's
fake process group (collectives that move nothing: shapes, schedules and control flow are
the real ones). No configuration may pass the check and then fail inside a run, and none may
crash with a traceback."""

from __future__ import annotations

import random
import re
import traceback

import pytest

from tests.conftest import tiny_overrides
from tests.dist import local_object_collectives, run_distributed

N_CONFIGS = 300
SEEDED = 30  # accepted multi-rank layouts run again under another hash seed
SEED = 20261203
FIELD = re.compile(r"^(model|data|optim|parallel|train|checkpoint)(\.\w+)?[:\s]")


def wild_values(rng: random.Random) -> tuple[int, dict]:
    """(world size, overrides) with every value drawn on its own: mostly impossible together."""
    heads = rng.choice([1, 2, 3, 4, 4, 6, 8])
    return rng.choice([1, 2, 3, 4, 4, 6, 8, 8, 12, 16]), {
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": rng.choice([k for k in (1, 2, 3, 4, heads) if k <= heads]
                                                + [3]),
        "model.hidden_size": 8 * heads,
        "model.intermediate_size": rng.choice([32, 48, 64, 96]),
        "model.num_hidden_layers": rng.choice([1, 2, 3, 4, 5, 6]),
        "model.tie_word_embeddings": rng.choice(["false", "false", "true"]),
        "data.seq_len": rng.choice([8, 12, 16, 24, 32, 48, 64]),
        "train.global_batch_size": rng.choice([1, 2, 3, 4, 6, 8, 12, 16]),
        "train.micro_batch_size": rng.choice([1, 2, 3, 4, 8]),
        "train.activation_checkpointing": rng.choice(["false", "true"]),
        "parallel.tp": rng.choice([1, 1, 2, 2, 3, 4]),
        "parallel.pp": rng.choice([1, 1, 2, 2, 3, 4]),
        "parallel.cp": rng.choice([1, 1, 2, 2, 3, 4]),
        "parallel.cp_algorithm": rng.choice(["ring", "allgather"]),
        "parallel.dp_replicate": rng.choice([1, 1, 1, 2]),
        "parallel.dp_shard": rng.choice([-1, -1, -1, 1, 2, 3]),
        "parallel.vpp": rng.choice([1, 1, 2, 3]),
        "parallel.schedule": rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v",
                                         "dualpipe-v"]),
        "parallel.microbatches": rng.choice([0, 0, 0, 2, 4, 8]),
        "parallel.zero_stage": rng.choice([0, 1, 2, 3]),
        "parallel.sequence_parallel": rng.choice(["false", "true"]),
        "parallel.offload_optimizer": rng.choice(["false", "false", "true"]),
        "parallel.pipeline_split": rng.choice(["params", "params", "uniform", "flops", "1,2",
                                               "2,1,1"]),
    }


def planned_values(rng: random.Random) -> tuple[int, dict]:
    """(world size, overrides) built to meet every rule: degrees first (at most 16 ranks),
    then heads, layers, sequence length and batch to suit them."""
    while True:
        tp, cp, pp = rng.choice([1, 1, 2, 2, 4]), rng.choice([1, 1, 2, 2, 4]), \
            rng.choice([1, 1, 2, 2, 3])
        rep, shard = rng.choice([1, 1, 2]), rng.choice([1, 1, 2, 3])
        world = tp * cp * pp * rep * shard
        if world <= 16:
            break
    heads = tp * rng.choice([1, 2])
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0 and (k % tp == 0
                                                                          or tp % k == 0)])
    vpp = rng.choice([1, 1, 2]) if pp > 1 else 1
    sp = tp > 1 and rng.random() < 0.5
    unit = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    seq = unit * rng.choice([k for k in range(1, 9) if 8 <= unit * k <= 64] or [1])
    mb, accum = rng.choice([1, 2]), rng.choice([1, 2, 3, 4]) * (pp if pp > 1 else 1)
    schedules = ["interleaved-1f1b", "zb-v", "dualpipe-v"] if vpp == 2 else \
        ["interleaved-1f1b"] if vpp > 1 else ["gpipe", "1f1b", "zb-h1"]
    return world, {
        "model.num_attention_heads": heads, "model.num_key_value_heads": kv,
        "model.hidden_size": 8 * heads,
        "model.intermediate_size": rng.choice([32, 48, 64, 96]),
        "model.num_hidden_layers": pp * vpp + rng.choice([0, 0, 1, 2]),
        "model.tie_word_embeddings": rng.choice(["false", "true"]) if pp == 1 else "false",
        "data.seq_len": seq,
        "train.global_batch_size": rep * shard * mb * accum,
        "train.micro_batch_size": mb,
        "train.activation_checkpointing": rng.choice(["false", "true"]),
        "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp,
        "parallel.cp_algorithm": rng.choice(["ring", "allgather"]),
        "parallel.dp_replicate": rep,
        "parallel.dp_shard": rng.choice([-1, shard]),
        "parallel.vpp": vpp,
        "parallel.schedule": rng.choice(schedules),
        "parallel.microbatches": rng.choice([0, accum]),
        "parallel.zero_stage": rng.choice([0, 1, 2, 3]),
        "parallel.sequence_parallel": "true" if sp else "false",
        "parallel.offload_optimizer": rng.choice(["false", "false", "true"]),
        "parallel.pipeline_split": rng.choice(["params", "uniform", "flops"]),
    }


def random_config(rng: random.Random) -> tuple[int, dict]:
    """A planned layout (meant to be accepted) with, in about half the draws, one to three of
    its values (or the world size) swapped for wild ones in three draws of five, so that
    refusals come one rule at a time near valid layouts; one draw in ten is wild throughout."""
    if rng.random() < 0.1:
        return wild_values(rng)
    world, extra = planned_values(rng)
    if rng.random() < 0.6:
        wild_world, wild = wild_values(rng)
        for key in rng.sample(sorted(wild) + ["world"], rng.choice([1, 1, 2, 3])):
            if key == "world":
                world = wild_world
            else:
                extra[key] = wild[key]
    return world, extra


def _configs():
    rng = random.Random(SEED)
    return [random_config(rng) for _ in range(N_CONFIGS)]


def _try_all(rank, world, corpus, cache, root, configs, only=None):
    """In one process: check every configuration (or those of indices ``only``); for each
    accepted one, the dry run and one real training step of one of its ranks on a fake
    process group. Returns the refusals (message) and the failures (traceback) per
    configuration index, the indices trained, and for each trained on a fake group the stream
    of collectives its rank issued (``Ledger.stream``: op, axis, dtype, size, phase)."""
    import os

    import torch.distributed as dist

    from threefold.config import ConfigError, load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.layout import validate_layout
    from threefold.launch.dryrun import predict
    from threefold.training.train import train

    local_object_collectives(dist)
    pick = random.Random(SEED + 1)
    refused, failed, trained, streams = {}, {}, [], {}
    for i, (w, extra) in enumerate(configs):
        r = pick.randrange(max(w, 1))  # drawn for every configuration: the same rank each time
        if only is not None and i not in only:
            continue
        out = root / f"c{i}"
        # one rank alone cannot write a checkpoint (rank 0 hashes every rank's files): saves
        # are the multi-process tests' business (test_checkpoint, test_checkpoint_nodes)
        over = tiny_overrides(corpus, cache, out, train__steps=1, train__eval_batches=1,
                              checkpoint__save_final="false",
                              **{k.replace(".", "__"): v for k, v in extra.items()})
        try:
            cfg = load_config(None, over)
            validate_layout(cfg, w, cfg.model.resolved(320))
        except ConfigError as e:
            refused[i] = str(e)
            continue
        except Exception:  # noqa: BLE001 - a traceback instead of a refusal is the failure
            failed[i] = "check: " + traceback.format_exc()
            continue
        try:
            predict(cfg, w)
            if w == 1:
                train(cfg)
            else:
                os.environ.update(RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r))
                dist.init_process_group("fake", store=dist.HashStore(), rank=r, world_size=w)
                try:
                    layout = Distributed(cfg)
                    train(cfg, layout)
                    streams[i] = layout.ledger.stream
                finally:
                    dist.destroy_process_group()
            trained.append(i)
        except Exception:  # noqa: BLE001
            failed[i] = f"rank {r} of {w}: " + traceback.format_exc()
    return refused, failed, trained, streams


@pytest.mark.slow
def test_every_random_layout_is_refused_by_name_or_trains(corpus, cache_dir, tmp_path):
    configs = _configs()
    refused, failed, trained, streams = run_distributed(
        _try_all, 1, corpus, cache_dir, tmp_path, configs, timeout=900, hash_seeds=(0,))[0]
    report = "\n".join(f"config {i} (world {configs[i][0]}, {configs[i][1]}):\n"
                       f"{tb}" for i, tb in failed.items())
    assert not failed, f"{len(failed)} configurations failed after the check:\n{report}"
    unnamed = {i: m for i, m in refused.items() if not FIELD.match(m)}
    assert not unnamed, f"refusals that name no field: {unnamed}"
    assert len(refused) + len(trained) == N_CONFIGS
    # the generator reaches both outcomes, and the accepted ones cover the axes
    assert len(trained) >= N_CONFIGS // 10 and len(refused) >= N_CONFIGS // 4
    used = {k for i in trained for k, v in configs[i][1].items()
            if k.startswith("parallel.") and v not in (1, 0, "false", -1)}
    assert {"parallel.tp", "parallel.pp", "parallel.cp", "parallel.zero_stage"} <= used
    # The order of a rank's collectives is the configuration's alone: the same rank of the
    # first accepted multi-rank layouts, in a process with another hash seed, issues the same
    # calls in the same order.
    again = sorted(streams)[:SEEDED]
    assert len(again) == SEEDED
    _, failed2, _, streams2 = run_distributed(_try_all, 1, corpus, cache_dir, tmp_path / "seed1",
                                              configs, set(again), timeout=600,
                                              hash_seeds=(1,))[0]
    assert not failed2, failed2
    for i in again:
        a, b = streams[i], streams2[i]
        k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (f"config {i} (world {configs[i][0]}, {configs[i][1]}): call {k + 1} "
                        f"differs between hash seeds 0 and 1: {a[k:k + 1]} against {b[k:k + 1]}")
