"""``threefold plan``'s command line: its options, grouped (the cluster, the workload, the
search, the output), and the usage error that exits 2 with one line."""

from __future__ import annotations

import argparse

from threefold.config import (CP_ALGORITHMS, EP_DISPATCHES, FP8_RECIPES, MODEL_PRESETS,
                              ConfigError)
from threefold.hardware.catalogue import GPUS
from threefold.plan.checkpoint_interval import LLAMA3_WRITE_GBPS
from threefold.plan.network import CLUSTERS
from threefold.plan.search import CP_MIN_SEQ_LEN

# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
class UsageError(Exception):
    pass


class PlanParser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line and exit 2 (through main) instead of argparse's usage + message."""
        raise UsageError(message)


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")


def choices(flag: str, text: str | None, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated subset of ``allowed`` (all of them when ``text`` is empty);
    ConfigError naming ``flag`` for anything else."""
    if not text:
        return allowed
    chosen = tuple(text.split(","))
    bad = [c for c in chosen if c not in allowed]
    if bad:
        raise ConfigError(f"{flag}: '{bad[0]}' is not one of {', '.join(allowed)}")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    """The ``threefold plan`` options."""
    p = PlanParser(prog="threefold plan", description="Rank parallel layouts by predicted step "
                "time. Throughput counts recomputation (hardware TF/s, as Narayanan et al. "
                "report); MFU does not (PaLM's definition).")
    add_cluster_options(p)
    add_workload_options(p)
    add_search_options(p)
    add_output_options(p)
    return p


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """The model and the cluster: how many GPUs, which, and overrides of its figures."""
    p.add_argument("--model", default="llama3-8b",
                   help="a Hugging Face folder, config.json or hub id org/name[@revision] "
                   f"(its config alone is read), a preset ({', '.join(MODEL_PRESETS)}) or a "
                   "TOML file with [model]")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in total")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink")
    p.add_argument("--gpu", default="h100", help=f"catalogue entry: {', '.join(GPUS)}")
    p.add_argument("--peak-tflops", type=float, help="override: dense peak TF/s at --precision")
    p.add_argument("--memory-gb", type=float, help="override: GPU memory, GB (1e9 bytes)")
    p.add_argument("--intra-bw-gbps", type=float,
                   help="override: NVLink GB/s per GPU as datasheets state it (both directions"
                   " summed, e.g. 900 for H100)")
    p.add_argument("--inter-bw-gbps", type=float,
                   help="override: network Gb/s (bits) per GPU per direction, e.g. 400")


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """The batch, the sequence, the numerics, whose block, how ranks sit on the network."""
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default min(4096, model))")
    p.add_argument("--global-batch-tokens", type=int, default=4 * 1024 * 1024,
                   help="tokens per optimiser step (a multiple of --seq-len)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 mixed precision with fp32 Adam (16 bytes/param), or fp32")
    p.add_argument("--fp8", choices=FP8_RECIPES, default="none",
                   help="as train.fp8: the blocks' projections and routed experts in FP8, at "
                        "the GPU's FP8 peak")
    p.add_argument("--mlp-tiles", type=int, default=1, metavar="N",
                   help="as train.mlp_tiles: each dense MLP over the sequence in N tiles, "
                   "recomputed in backward (its activations stop growing with length)")
    p.add_argument("--attention", choices=("flash", "eager"), default="flash",
                   help="flash: attention probabilities not stored; eager: stored")
    p.add_argument("--block", choices=("threefold", "megatron"), default="threefold",
                   help="whose transformer block keeps the activations: threefold's own (as "
                   "its autograd saves them) or a fused Megatron-Core block (Korthikanti et "
                   "al.'s count for RMSNorm, GQA, SwiGLU: sharded inputs under sequence "
                   "parallelism, fused norms and SwiGLU), to plan or check published runs")
    p.add_argument("--mesh-order", choices=("threefold", "dp-outer"), default="threefold",
                   help="how ranks are laid out on the network: threefold's mesh (pp "
                   "outermost, tp innermost) or dp-outer (Llama 3's [TP, CP, PP, DP]: "
                   "pipelines inside a pod, data parallelism across), for published runs")


def add_search_options(p: argparse.ArgumentParser) -> None:
    """What the search may try: degrees, ZeRO stages, cp, ep, recompute, offload."""
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    p.add_argument("--tp", type=int_list, help="only these tp degrees (comma list)")
    p.add_argument("--pp", type=int_list, help="only these pp degrees")
    p.add_argument("--pipeline-split",
                   help="the runtime's parallel.pipeline_split values to search with pp > 1 "
                   "(comma list): params (the first and last stages take fewer blocks, for "
                   "the embedding and head), flops, uniform; default: params, and flops "
                   "where it lowers the busiest stage's FLOPs (a mixture of experts)")
    p.add_argument("--zero-stage", type=int_list, help="only these ZeRO stages")
    p.add_argument("--cp", type=int_list,
                   help="only these context-parallel degrees (default: 1, and every one that "
                   f"splits the sequence when --seq-len >= {CP_MIN_SEQ_LEN} or nothing fits "
                   "without)")
    p.add_argument("--cp-algorithm", help="only these cp algorithms (comma list): "
                   + ",".join(CP_ALGORITHMS))
    p.add_argument("--cp-ulysses", type=int_list,
                   help="hybrid cp: only these Ulysses (all-to-all) degrees inside cp, the ring "
                   "or all-gather over the rest; 1 = the algorithm alone (default: 1 and every "
                   "divisor of cp, where the runtime has Ulysses)")
    p.add_argument("--ep", type=int_list,
                   help="only these expert-parallel degrees (a mixture of experts; default: "
                   "every divisor of the experts that divides dp_shard)")
    p.add_argument("--ep-dispatch", choices=EP_DISPATCHES, default="flat",
                   help="as parallel.ep_dispatch: flat (one all-to-all over ep) or "
                   "hierarchical (over the network once per destination node, then NVLink "
                   "inside it; ep split by --gpus-per-node)")
    p.add_argument("--recompute", help="only these: none,selective,full, or a selective "
                   "policy as the table prints it, e.g. selective:layernorm+mla_up_proj+moe_act")
    p.add_argument("--recompute-modules",
                   help="what selective recompute recomputes, as train.recompute_modules (comma "
                   "list of core_attn, layernorm, mla_up_proj, moe_act, mlp, moe, "
                   "shared_experts; DeepSeek-V3's: layernorm,mla_up_proj,moe_act), for every "
                   "--recompute mode given (default: selective only); default: the default "
                   "policy, and DeepSeek-V3's too for latent attention")
    p.add_argument("--offload-optimizer", choices=("off", "on", "search"), default="off",
                   help="optimizer state and fp32 master in host memory (ZeRO-Offload): off, "
                        "on for every layout, or search both (zero column marked 'o')")
    p.add_argument("--tp-overlap", type=int, default=0, metavar="C", help="as parallel."
                   "tp_overlap: sequence-parallel collectives in C overlapped chunks; 0 = off")
    p.add_argument("--lora-r", type=int, default=0,
                   help="plan LoRA fine-tuning: adapters of this rank train, the base is "
                   "frozen (as lora.r; 0 = every weight trains); not for a mixture of experts")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-r: the adapted layers, as lora.target_modules "
                   "(default all-linear)")


def add_output_options(p: argparse.ArgumentParser) -> None:
    """What is printed, and the measured or published hardware to plan for instead."""
    p.add_argument("--json", action="store_true", help="print the top layouts as JSON")
    p.add_argument("--max-seq-len", action="store_true",
                   help="instead of ranking layouts at --seq-len: the longest sequence that "
                   "fits for each cp split (degree, algorithm; --cp and --cp-algorithm "
                   "narrow them), with the fastest layout there and its time per token")
    p.add_argument("--explain", action="store_true", help="say why each loses to the best, "
                   "and each layout's checkpoint interval (as checkpoint.interval auto)")
    p.add_argument("--mtbf-hours", type=float, default=0.0,
                   help="with --explain: the job's mean time between failures, hours (as "
                   "checkpoint.mtbf_hours; default: Llama 3's rate per GPU over the GPUs)")
    p.add_argument("--write-gbps", type=float, default=LLAMA3_WRITE_GBPS,
                   help="with --explain: storage write bandwidth per GPU, GB/s (as "
                   "checkpoint.write_gbps; default Llama 3's 2 TB/s over 16,384 GPUs)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul FLOP/s, memory and gloo all-reduce "
                   "bandwidth between local processes), print and save it, and exit")
    p.add_argument("--calibrate-out", default=None,
                   help="where --calibrate saves its JSON (default ~/.cache/threefold/"
                   "calibration.json)")
    p.add_argument("--calibrate-ranks", type=int, default=2,
                   help="local processes the all-reduce is measured between")
    p.add_argument("--hardware-file", default=None,
                   help="plan for the machine measured by --calibrate (that JSON) instead of "
                   "--gpu (every rank of a node shares its cores, memory and bandwidth); or a "
                   'cluster: {"gpu": "h100", "levels": [{"name": "nvlink", "gpus": 8, '
                   '"gb_s_per_gpu": 450, "latency_us": 2}, {"name": "spine", "gpus": 0, '
                   '"gbits_per_gpu": 400, "latency_us": 8, "oversubscription": 7}]}')
    p.add_argument("--cluster", default=None,
                   help="a published cluster's network levels: " + ", ".join(CLUSTERS))
