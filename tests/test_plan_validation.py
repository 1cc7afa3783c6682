"""The planner against published large-scale runs (thousands of GPUs): for each, the
predicted per-GPU throughput of the published layout within ±20% of the measured figure, and
the published (tp, pp) among the planner's five best distinct (tp, pp) layouts, searched with
the features the authors' system had (Megatron-LM of 2021: no ZeRO, full activation
recomputation, fp16, no flash attention, gradient all-reduce after the backward) on their
cluster (Selene: A100 80 GB, 8 per node on NVLink, 8 HDR InfiniBand 200 Gb/s cards per node).
Same constants as every other test (MATMUL_EFFICIENCY 0.58); TF/s count the recomputation, as
both papers do (Narayanan et al. Eq. 3).

Published figures (facts only):
- MT-NLG 530B (Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG
  530B", arXiv 2201.11990, §2): 105 layers, hidden 20480, 128 heads, sequence 2048, global
  batch 1920, tensor parallel 8, pipeline 35 on 280 / 350 / 420 DGX A100 nodes (2240 / 2800 /
  3360 GPUs): 126 / 121 / 113 TFLOP/s per GPU.
- Narayanan et al. 2021 (arXiv 2104.04473) Table 1, its two largest rows: 529.6B on 2520
  GPUs (tp 8, pp 35, batch 2520): 163 TF/s; 1T on 3072 GPUs (tp 8, pp 64, batch 3072): 163.
"""

from __future__ import annotations

import pytest

from threefold.accounting import Workload
from threefold.plan.candidates import SearchSpace
from threefold.plan.cli import load_model
from threefold.plan.compute import MATMUL_EFFICIENCY
from threefold.plan.hardware import Cluster, get_hardware
from threefold.plan.search import search

SELENE = get_hardware("a100").with_overrides(inter_node_bw=200 / 8 * 1e9)
MEGATRON_2021 = dict(zero_stage=(0,), recompute=("full",))

# (name, preset, GPUs, global batch, tp, pp, published TF/s per GPU)
PUBLISHED = [
    ("mt-nlg-2240", "gpt-530b", 2240, 1920, 8, 35, 126),
    ("mt-nlg-2800", "gpt-530b", 2800, 1920, 8, 35, 121),
    ("mt-nlg-3360", "gpt-530b", 3360, 1920, 8, 35, 113),
    ("narayanan-530b-2520", "gpt-530b", 2520, 2520, 8, 35, 163),
    ("narayanan-1t-3072", "gpt-1t", 3072, 3072, 8, 64, 163),
]


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0] for r in PUBLISHED])
def test_published_layout_within_20_percent_and_in_the_top_5(row):
    name, preset, gpus, batch, tp, pp, published = row
    cfg = load_model(preset)
    work = Workload(seq_len=2048, global_batch=batch, flash_attention=False)
    cluster = Cluster(SELENE, gpus, 8)
    mine = search(cfg, cluster, work, SearchSpace(tp=(tp,), pp=(pp,), **MEGATRON_2021),
                  keep=1, overlap_grad_reduce=False).ranked[0]
    assert mine.layout.dp == gpus // (tp * pp)
    assert mine.step.tflops_per_gpu == pytest.approx(published, rel=0.20), mine.layout
    ranked = search(cfg, cluster, work, SearchSpace(**MEGATRON_2021), keep=60,
                    overlap_grad_reduce=False).ranked
    distinct: list[tuple[int, int]] = []
    for c in ranked:
        if (c.layout.tp, c.layout.pp) not in distinct:
            distinct.append((c.layout.tp, c.layout.pp))
    assert (tp, pp) in distinct[:5], distinct[:5]
    assert MATMUL_EFFICIENCY == 0.58
