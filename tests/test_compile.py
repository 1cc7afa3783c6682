"""``train.compile true`` (each block, and the head with its chunked loss where the
vocabulary is whole, through torch.compile, inductor) trains to the eager losses under data
parallel, ZeRO-3, tensor parallel and pipeline parallel (fp32, rel 1e-5).

One 2-rank launch runs every layout eagerly and compiled, 3 steps each. The first compile in
a process costs tens of seconds on this CPU; inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under the system's temporary directory) makes later
runs of the suite cheaper."""

from __future__ import annotations

import pytest

from tests.conftest import metrics, tiny_overrides
from tests.dist import run_distributed
from threefold.config import load_config

LAYOUTS = {
    "dp": {"parallel__dp_shard": 2},
    "zero3": {"parallel__zero_stage": 3},
    "tp": {"parallel__tp": 2, "parallel__dp_shard": 1},
    "pp": {"parallel__pp": 2, "parallel__dp_shard": 1, "train__micro_batch_size": 4},
}


def _eager_and_compiled(rank, world, corpus, cache, root):
    """Every layout eagerly, then compiled; returns whether each compiled run's blocks were
    compiled."""
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    compiled = {}
    for name, extra in LAYOUTS.items():
        for mode in ("eager", "compiled"):
            cfg = load_config(None, tiny_overrides(
                corpus, cache, root / f"{name}_{mode}", train__steps=3,
                train__compile="true" if mode == "compiled" else "false", **extra))
            _, run = train(cfg, Distributed(cfg), return_run=True)
            if mode == "compiled":
                blocks = [b for b in run.engine.model.model.layers if b is not None]
                head = run.engine.model.lm_head  # compiled with its loss, unless vocab-parallel
                if head is not None and head.shard is None:
                    blocks.append(head)
                compiled[name] = bool(blocks) and all(
                    getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    return compiled


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_under_every_engine(corpus, cache_dir, tmp_path):
    results = run_distributed(_eager_and_compiled, 2, corpus, cache_dir, tmp_path,
                              timeout=900)
    for name in LAYOUTS:
        assert all(r[name] for r in results), f"{name}: blocks not compiled"
        eager = [m["loss"] for m in metrics(tmp_path / f"{name}_eager")]
        compiled = [m["loss"] for m in metrics(tmp_path / f"{name}_compiled")]
        assert len(compiled) == len(eager) == 3
        assert compiled == pytest.approx(eager, rel=1e-5), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_block_is_one_graph(dtype):
    """Dynamo traces a whole block without a graph break: under torch.compile the lean
    kernels (threefold.model.kernels) are plain ops, so inductor can fuse across them."""
    import contextlib

    import torch

    from threefold.config import ModelConfig
    from threefold.model.decoder import CausalLM

    cfg = ModelConfig(preset="tiny", vocab_size=512, num_hidden_layers=1).resolved()
    model = CausalLM(cfg)
    x = torch.randn(2, 32, cfg.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(32).expand(2, 32))
    auto = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" \
        else contextlib.nullcontext()
    with auto:
        explained = torch._dynamo.explain(model.model.layers[0])(x, cos, sin)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, \
        [b.reason for b in explained.break_reasons]


def test_the_head_and_its_loss_are_one_graph():
    """The chunked head loss (threefold.model.head_loss) traces as one graph, chunks and all."""
    import torch

    from threefold.model.head_loss import LMHead

    head = LMHead(32, 96)
    head.chunk = 5
    h = torch.randn(2, 12, 32, requires_grad=True)
    explained = torch._dynamo.explain(head)(h, labels=torch.randint(0, 96, (2, 12)))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, \
        [b.reason for b in explained.break_reasons]
