"""Loading reads only what a rank owns. Each rank of a tp 2 × ZeRO-3 layout (4 ranks, one at a
time on torch's fake process group: loading needs no collective) starts from a Hugging Face
folder of a ~350M-parameter Llama written by the test, and its loader reads, by its own
count of bytes (the page cache hides file reads from RSS), no more than the rank's share plus
one tensor; the four ranks together read the file about once. The values a rank takes equal
the same region of the whole tensors (checked on the shards against the file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import tiny_overrides
from tests.dist import run_distributed

SHAPE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
             num_attention_heads=8, num_key_value_heads=4)


def _write_hf(folder) -> tuple[int, int]:
    """A bf16 Llama folder of SHAPE with random weights; (file bytes, largest tensor bytes)."""
    from threefold.config import ModelConfig
    from threefold.data import train_bpe
    from threefold.weights.hf_config import expected_shapes, hf_config

    cfg = ModelConfig(**SHAPE).resolved()
    gen = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
               for n, s in expected_shapes(cfg).items()}
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(cfg)))
    # the vocabulary comes with the weights (training from a folder without one is refused)
    train_bpe([Path(__file__).read_text()], 300).save(str(folder / "tokenizer.json"))
    return (sum(t.numel() * 2 for t in tensors.values()),
            max(t.numel() * 2 for t in tensors.values()))


def _load_every_rank(rank, world, corpus, cache, root, hf_dir):
    """In one process: each rank of tp 2 × dp_shard 2 (ZeRO-3) builds its part from the
    folder on a fake process group; its bytes read and its owned elements."""
    import os

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")

    from tests.dist import local_object_collectives
    from threefold.config import load_config
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import build_run

    local_object_collectives(dist)
    out = []
    for r in range(4):
        over = tiny_overrides(corpus, cache, root / f"r{r}", parallel__tp=2,
                              parallel__zero_stage=3, checkpoint__init_from=str(hf_dir),
                              data__seq_len=64, train__global_batch_size=2,
                              train__micro_batch_size=1)
        cfg = load_config(None, [(k, v) for k, v in over if not k.startswith("model.")])
        os.environ.update(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r))
        dist.init_process_group("fake", store=dist.HashStore(), rank=r, world_size=4)
        try:
            run = build_run(cfg, Distributed(cfg))
            eng = run.engine
            shards = {u.name: u.shard.detach().clone() for u in eng.all_units}
            named = {u.name: list(zip(u.names, u.shapes, u.offsets, u.params))
                     for u in eng.all_units}
            check = _compare_with_file(hf_dir, eng)
            out.append({"read": run.memory["init_from_bytes_read"],
                        "owned": sum(s.numel() for s in shards.values()), "check": check,
                        "units": len(named)})
        finally:
            dist.destroy_process_group()
    return out


def _compare_with_file(hf_dir, eng) -> int:
    """How many owned shard elements differ from the same elements of the file's tensors
    (tp slice, then the flat range of the shard): 0 expected."""
    from safetensors import safe_open

    from threefold.parallel.placement import logical_box

    bad = 0
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for u in eng.all_units:
            lo = eng.comm.rank(u.axis) * u.shard_numel
            for name, shape, off, p in zip(u.names, u.shapes, u.offsets, u.params):
                a, b = max(lo, off), min(lo + u.shard_numel, off + math.prod(shape))
                if b <= a:
                    continue
                src, dst = logical_box(p)
                local = torch.zeros(shape)
                local[tuple(slice(x, y) for x, y in dst)] = \
                    f.get_tensor(name)[tuple(slice(x, y) for x, y in src)].float()
                want = local.reshape(-1)[a - off:b - off]
                bad += int((u.shard.detach()[a - lo:b - lo] != want).sum())
    return bad


@pytest.mark.slow
def test_tp_zero3_load_reads_only_the_share(corpus, cache_dir, tmp_path):
    hf_dir = tmp_path / "hf"
    total, largest = _write_hf(hf_dir)
    assert total > 500e6  # ~350M parameters in bf16
    ranks = run_distributed(_load_every_rank, 1, corpus, cache_dir, tmp_path, hf_dir,
                            timeout=600)[0]
    for r, got in enumerate(ranks):
        print(f"rank {r}: read {got['read'] / 1e6:.1f} MB, share {got['owned'] * 2 / 1e6:.1f} MB,"
              f" file {total / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB")
        assert got["check"] == 0, f"rank {r}: shard values differ from the file's"
        share = got["owned"] * 2  # its elements, in the file's bf16
        assert got["read"] <= share + largest, (r, got["read"], share, largest)
        assert got["read"] < total / 2  # nowhere near the whole file
    # together the four ranks read the file about once (rows shared at shard edges)
    assert sum(g["read"] for g in ranks) < 1.05 * total
