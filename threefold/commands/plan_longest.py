"""``threefold plan --max-seq-len``: the longest sequence the model fits on the cluster for
each context-parallel split (``threefold.plan.longest``), as a table or JSON."""

from __future__ import annotations

import json
import time

from threefold.accounting import num_parameters
from threefold.config import ModelConfig
from threefold.layout import Workload
from threefold.plan.candidates import SearchSpace
from threefold.plan.cluster import Cluster
from threefold.plan.longest import Longest, longest_sequences
from threefold.plan.terms import count_text


def _layout_text(row: Longest) -> str:
    if row.best is None:
        return "nothing fits"
    lay = row.best.layout
    return (f"tp {lay.tp} pp {lay.pp}" + (f" vpp {lay.vpp}" if lay.vpp > 1 else "")
            + f" zero {lay.zero_stage}" + ("o" if lay.offload_optimizer else "")
            + f" recompute {lay.recompute}")


def _json_row(row: Longest) -> dict:
    out = {"cp": row.cp, "cp_algorithm": row.algorithm if row.cp > 1 else None,
           "cp_ulysses": row.ulysses, "max_seq_len": row.seq_len, "sequences_per_step": row.batch}
    if row.best is not None:
        lay, step = row.best.layout, row.best.step
        out.update(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, zero_stage=lay.zero_stage,
                   recompute=lay.recompute, offload_optimizer=lay.offload_optimizer,
                   memory_bytes_per_gpu=row.best.memory.total, step_time_s=step.step_time_s,
                   seconds_per_token=row.seconds_per_token,
                   tokens_per_second_per_gpu=step.tokens_per_second_per_gpu, mfu=step.mfu)
    return out


def print_longest(args, cfg: ModelConfig, cluster: Cluster, work: Workload,
                  space: SearchSpace) -> int:
    """Print the table (or ``--json``); exit 1 when no split fits even the shortest length."""
    cpu = time.process_time()
    rows = longest_sequences(cfg, cluster, work, space, args.global_batch_tokens)
    cpu = time.process_time() - cpu
    if args.json:
        print(json.dumps([_json_row(r) for r in rows], indent=1))
        return 0 if any(r.seq_len for r in rows) else 1
    hw = cluster.hardware
    print(f"{args.model}: {count_text(num_parameters(cfg))} parameters on {cluster.num_gpus} x "
          f"{hw.name} ({hw.memory_bytes / 1e9:.0f} GB, {cluster.gpus_per_node} per node), "
          f"{work.precision}, {args.global_batch_tokens} tokens per step"
          + (f", MLP in {work.mlp_tiles} tiles" if work.mlp_tiles > 1 else ""))
    print(f"the longest sequence each context-parallel split fits (micro-batches of one "
          f"sequence; searched in {cpu:.1f} s of CPU):")
    head = ("cp", "algorithm", "max seq_len", "seqs/step", "fastest layout there", "GB/GPU",
            "us/token", "tok/s/GPU", "MFU")
    table = [head]
    for r in rows:
        step = r.best.step if r.best else None
        split = "-" if r.cp == 1 else r.algorithm + (
            f" x ulysses {r.ulysses}" if r.ulysses > 1 else "")
        table.append((str(r.cp), split, f"{r.seq_len:,}",
                      str(r.batch), _layout_text(r),
                      f"{r.best.memory.total / 1e9:.1f}" if r.best else "-",
                      f"{r.seconds_per_token * 1e6:.1f}" if r.best else "-",
                      f"{step.tokens_per_second_per_gpu:,.0f}" if step else "-",
                      f"{step.mfu:.1%}" if step and step.mfu is not None else "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    longest = max(r.seq_len for r in rows)
    if longest > cfg.max_position_embeddings:
        print(f"note: lengths past the model's max_position_embeddings "
              f"({cfg.max_position_embeddings:,}) fit in memory but need its positions "
              "extended (RoPE scaling) to train")
    print("us/token: the cluster's step time per token trained at that length (attention "
          "grows with it)")
    return 0 if longest else 1
