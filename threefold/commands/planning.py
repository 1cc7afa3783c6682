"""`threefold plan`: rank every parallel layout of a model on a cluster by predicted step time.

The search enumerates (dp_replicate, dp_shard, cp, cp_algorithm, tp, pp, vpp, zero_stage,
microbatch_size, recompute) whose product is the world and which divide the model and the
batch, drops those that do not fit in memory (keeping the reason), scores the rest with
``threefold.accounting`` and ``threefold.plan.memory``, and explains the ranking. Imports no
torch: the 1024-GPU search for a 70B model takes a second or two.

Conventions: tensor parallelism runs with sequence parallelism; zero_stage 0 means plain data
parallelism over dp_shard (dp_replicate = 1); vpp > 1 means interleaved 1F1B; mesh axes are
ordered pp, dp_replicate, dp_shard, cp, tp (outermost first), so tp stays inside a node when it
can, and a layout whose tp group crosses nodes is flagged.

Context parallelism (cp > 1, each sequence split over cp ranks) multiplies the search by the
cp degrees times the two algorithms, and only pays at long sequences, so it is searched only
when ``seq_len >= CP_MIN_SEQ_LEN``, or when no layout without it fits in memory (the search
then runs again with it), or when asked for (``SearchSpace.cp``, ``--cp``). cp takes the
divisors of world/tp for which seq_len divides by 2·cp and each cp rank's tokens by tp. When
the best layout uses cp, ``PlanResult.notes`` says why: no cp = 1 layout fits (and what the
smallest needs), or how much slower the best one without cp is. Memory is threefold's runtime's
(``threefold.plan.memory``), numerics the published mixed-precision ones (``Workload``).

The hardware is a catalogue GPU (``--gpu``, overridable) or this machine as measured by
``--calibrate`` (``threefold.plan.calibrate``), read back with ``--hardware-file``.

A mixture of experts (``model.num_local_experts``, threefold.model.moe) is planned as the runtime
runs it (threefold.parallel.transforms.expert): the search adds the expert-parallel degree ep (every
divisor of the experts that divides dp_shard, ``SearchSpace.ep``, ``--ep``); tp runs without
sequence parallelism (the MoE is whole on every tp rank) and cp is not searched (the runtime
refuses MoE with cp). Memory counts every expert a rank holds (E/ep per block, sharded by
ZeRO over dp_shard/ep: ``memory_per_rank``); FLOPs and MFU the active parameters (the router
and k experts per token); the ep all-to-alls are the uniform-routing expectation, exposed on
the link the ep axis crosses (an ep group that leaves the node is flagged).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from threefold.accounting import active_parameters, num_parameters, tp_shard
from threefold.weights.checkpoint_verify import read_json
from threefold.config import (CP_ALGORITHMS, MODEL_PRESETS, RECOMPUTE_MODES,
                              RECOMPUTE_MODULES, ConfigError, LoRAConfig, ModelConfig,
                              ParallelConfig, load_config, module_names)
from threefold.config.validation import LORA_TARGETS, lora_targets
from threefold.weights.hf_config import HFError, model_config_from_hf
from threefold.weights.hub import hub_id, locate
from threefold.layout import Workload, rules
from threefold.weights.model_source import read_model
from threefold.plan.calibrate import (DEFAULT_PATH, calibrate, hardware_from_calibration, load,
                                      save)
from threefold.plan.candidates import SearchSpace
from threefold.plan.checkpoint_interval import layout_interval
from threefold.hardware.catalogue import Hardware, get_hardware
from threefold.plan.cluster import Cluster, Level
from threefold.plan.report import moe_notes, summary_lines, format_table, to_json_rows
from threefold.plan.search import search
from threefold.plan.terms import count_text
from threefold.plan.network import CLUSTERS, levels_from_record
from threefold.commands.plan_longest import print_longest
from threefold.commands.plan_options import UsageError, build_parser, choices

def load_model(spec: str) -> ModelConfig:
    """A resolved ModelConfig from ``--model``, tried in this order: an existing path (a TOML
    file's [model] and [data] tables; a Hugging Face ``config.json``; a Hugging Face folder or
    a threefold run or checkpoint directory), a preset, a hub id ``org/name[@revision]``
    (its config.json alone is fetched). Only configurations are read, never weights."""
    path, vocab = Path(spec).expanduser(), 0
    if path.is_file() and path.suffix == ".toml":
        full = load_config(spec, validate_now=False)
        cfg, vocab = full.model.resolved(full.data.vocab_size), full.data.vocab_size
    elif path.exists() or hub_id(spec):  # (no preset is written org/name)
        cfg = _pretrained_model(spec, path)
    elif spec in MODEL_PRESETS:
        cfg = ModelConfig(preset=spec).resolved()
    else:
        raise ConfigError(f"--model: '{spec}' is neither a path, a preset "
                          f"({', '.join(MODEL_PRESETS)}) nor a Hugging Face hub id "
                          "(org/name[@revision])")
    if not cfg.vocab_size:
        # presets without a vocabulary use the tokenizer's; plan with the default BPE size
        cfg.vocab_size = vocab or 4096
    return cfg


def _pretrained_model(spec: str, path: Path) -> ModelConfig:
    """The model of a config.json file, or of a folder or hub id (``threefold.weights.model_source``)."""
    if path.is_file():
        try:
            conf = read_json(path, HFError, "", "neither TOML nor JSON")
            return model_config_from_hf(conf, str(path))
        except HFError as e:
            raise ConfigError(f"--model: {e}") from None
    located = locate(spec, "--model", config_only=True)
    return read_model(located.path, located.name, "--model")


def _hardware_record(args) -> dict | None:
    """The --hardware-file JSON: a --calibrate record, or a cluster description
    ({"gpu": catalogue name, "levels": [...]}, see ``plan.topology.levels_from_record``)."""
    if not args.hardware_file:
        return None
    try:
        record = json.loads(Path(args.hardware_file).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hardware-file: cannot read {args.hardware_file}: {e}") from None
    if isinstance(record, dict) and "levels" in record:
        return record
    return load(args.hardware_file)


def _levels(args, record: dict | None) -> tuple[Level, ...]:
    """Topology levels: the hardware file's ``levels``, or --cluster's, or none (one network)."""
    if record and "levels" in record:
        return levels_from_record(record["levels"], args.gpus_per_node)
    if args.cluster:
        if args.cluster not in CLUSTERS:
            raise ConfigError(f"--cluster: unknown '{args.cluster}'; known: "
                              f"{', '.join(CLUSTERS)}")
        return levels_from_record(CLUSTERS[args.cluster], args.gpus_per_node)
    return ()


def _hardware(args, record: dict | None = None) -> Hardware:
    if record and "levels" in record:
        hw = get_hardware(record.get("gpu", args.gpu))
    elif record:
        hw = hardware_from_calibration(record, min(args.gpus, args.gpus_per_node))
    else:
        hw = get_hardware(args.gpu)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    return hw.with_overrides(
        peak_flops_16bit=peak if args.precision == "bf16" else None,
        peak_flops_fp32=peak if args.precision == "fp32" else None,
        memory_bytes=None if args.memory_gb is None else args.memory_gb * 1e9,
        intra_node_bw=None if args.intra_bw_gbps is None else args.intra_bw_gbps / 2 * 1e9,
        inter_node_bw=None if args.inter_bw_gbps is None else args.inter_bw_gbps / 8 * 1e9)


def _setup(args):
    cfg = load_model(args.model)
    for name in ("gpus", "gpus_per_node", "top", "global_batch_tokens", "mlp_tiles"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("peak_tflops", "memory_gb", "intra_bw_gbps", "inter_bw_gbps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive")
    seq = args.seq_len or min(4096, cfg.max_position_embeddings)
    if seq < 1 or seq > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len: {seq} is outside 1..{cfg.max_position_embeddings} "
                          f"(the model's max_position_embeddings)")
    if args.global_batch_tokens % seq:
        raise ConfigError(f"--global-batch-tokens: {args.global_batch_tokens} is not a multiple "
                          f"of --seq-len {seq}")
    recompute = _recompute_choices(args.recompute)
    modules = None
    if args.recompute_modules:
        modules = (module_names(",".join(choices("--recompute-modules", args.recompute_modules,
                                                 RECOMPUTE_MODULES))),)
        if args.block == "megatron":
            raise ConfigError("--recompute-modules: Megatron's block (--block megatron) is "
                              "counted with its own selective recompute; use --block threefold")
        recompute = recompute if args.recompute else ("selective",)
    if args.zero_stage and any(z not in (0, 1, 2, 3) for z in args.zero_stage):
        raise ConfigError("--zero-stage: stages are 0, 1, 2, 3")
    algorithms = choices("--cp-algorithm", args.cp_algorithm, CP_ALGORITHMS)
    splits = choices("--pipeline-split", args.pipeline_split, ("params", "flops", "uniform")) \
        if args.pipeline_split else None  # None: params, and flops where it helps
    _refuse_degrees(cfg, args, seq)
    targets = _lora_options(cfg, args)
    work = Workload(seq_len=seq, global_batch=args.global_batch_tokens // seq,
                    precision=args.precision, flash_attention=args.attention == "flash",
                    block=args.block, lora_r=args.lora_r, lora_targets=targets, fp8=args.fp8,
                    mlp_tiles=args.mlp_tiles,
                    fp8_gather=args.fp8 == "tensorwise" and not args.lora_r
                    and not cfg.num_local_experts)
    record = _hardware_record(args)
    cluster = Cluster(_hardware(args, record), args.gpus, min(args.gpus_per_node, args.gpus),
                      _levels(args, record), mesh_order=args.mesh_order)
    if args.fp8 != "none" and not cluster.hardware.peak_flops("fp8"):
        raise ConfigError(f"--fp8: {cluster.hardware.name} has no FP8 peak; use --fp8 none or "
                          "--gpu h100, h200 or b200")
    tp = (1,) if args.fp8 != "none" and args.lora_r else args.tp  # FP8 under LoRA: tp 1
    space = SearchSpace(tp=tp, pp=args.pp, zero_stage=args.zero_stage or (0, 1, 2, 3),
                        recompute=recompute if args.recompute or modules else None,
                        recompute_modules=modules, cp=args.cp,
                        cp_algorithm=algorithms, cp_ulysses=_ulysses(args),
                        ep=args.ep, tp_overlap=args.tp_overlap,
                        ep_dispatch=args.ep_dispatch, gpus_per_node=cluster.gpus_per_node,
                        pipeline_split=None if splits is None else tuple(
                            f"flops:{seq}" if x == "flops" else x for x in splits),
                        offload_optimizer={"off": (False,), "on": (True,),
                                           "search": (False, True)}[args.offload_optimizer])
    return cfg, cluster, work, space


def _ulysses(args) -> tuple[int, ...] | None:
    """--cp-ulysses, refused where the runtime has no Ulysses to run a hybrid with."""
    if args.cp_ulysses and any(u > 1 for u in args.cp_ulysses) and \
            "ulysses" not in CP_ALGORITHMS:
        raise ConfigError("--cp-ulysses: this threefold has no Ulysses all-to-all "
                          f"(cp algorithms: {', '.join(CP_ALGORITHMS)}); use 1")
    if args.cp_ulysses and any(u < 1 for u in args.cp_ulysses):
        raise ConfigError("--cp-ulysses: degrees are >= 1 (1 = the algorithm alone)")
    return args.cp_ulysses


def _recompute_choices(text: str | None) -> tuple[str, ...]:
    """``--recompute``'s modes: none, selective, full, or a selective policy as the table
    prints it (selective:layernorm+mla_up_proj+moe_act), its modules sorted."""
    out = []
    for label in (text or ",".join(RECOMPUTE_MODES)).split(","):
        mode, _, mods = label.partition(":")
        choices("--recompute", mode, RECOMPUTE_MODES)
        if mods:
            if mode != "selective":
                raise ConfigError(f"--recompute: {label}: only selective takes modules "
                                  f"(selective:{mods})")
            names = choices("--recompute", mods.replace("+", ","), RECOMPUTE_MODULES)
            label = "selective:" + "+".join(module_names(",".join(names)))
        out.append(label)
    return tuple(out)


def _lora_options(cfg: ModelConfig, args) -> tuple[str, ...]:
    """--lora-r's targets, or () without LoRA; what LoRA does not run with refused by
    option."""
    if args.lora_r < 0:
        raise ConfigError(f"--lora-r: must be >= 0 (0 = no LoRA), got {args.lora_r}")
    if not args.lora_r:
        return ()
    targets = lora_targets(LoRAConfig(r=args.lora_r, target_modules=args.lora_targets))
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
        raise ConfigError(f"--lora-targets: {', '.join(bad) or 'nothing'} is not one of "
                          f"{', '.join(LORA_TARGETS)} (or all-linear)")
    rules.lora_without_experts(args.lora_r, cfg.num_local_experts or 0)
    if args.fp8 != "none" and any(t > 1 for t in args.tp or ()):  # as train.fp8's validation
        raise ConfigError(f"--fp8: {args.fp8} with --lora-r and --tp > 1 is not available "
                          "(the frozen layers' amaxes over tp are not modelled); use --tp 1")
    if args.offload_optimizer != "off":
        raise ConfigError("--offload-optimizer: not planned under LoRA (the adapters' "
                          "optimizer state is small); use off")
    return targets


def _refuse_degrees(cfg: ModelConfig, args, seq: int) -> None:
    """Explicit --tp, --pp, --cp and --ep are taken as given, or refused here by the rule book
    (``threefold.layout.rules``) with the message the runtime gives, rather than silently
    searched away: each must fit the GPUs (together, for tp, cp and pp), tp the attention
    heads (kv heads may replicate), pp the layers, cp the sequence and the model, ep the
    experts (any split of the layers that pp does not divide is the runtime's own,
    threefold.schedules.balance)."""
    experts = cfg.num_local_experts or 0
    for name in ("tp", "pp", "cp"):
        for v in getattr(args, name) or ():
            rules.divides_world(name, v, args.gpus)
    for tp in args.tp or ():
        tp_shard(cfg, tp)
    for pp in args.pp or ():
        rules.layers_fill_chunks(cfg.num_hidden_layers, pp, 1)
    for cp in args.cp or ():
        rules.seq_len_over_cp(seq, cp)
    combos = [ParallelConfig(tp=tp, cp=cp, pp=pp) for tp, cp, pp in itertools.product(
        args.tp or (1,), args.cp or (1,), args.pp or (1,))]
    if not any(c.tp * c.cp * c.pp <= args.gpus and args.gpus % (c.tp * c.cp * c.pp) == 0
               for c in combos):  # none of the degrees asked for fit together
        rules.fills_world(combos[0], args.gpus)
    for ep in args.ep or ():
        rules.ep_needs_experts(ep, experts)
        rules.ep_divides_experts(ep, experts, args.gpus)


def _calibrate(args) -> int:
    """``--calibrate``: measure, print, save."""
    if args.calibrate_ranks < 2:
        print("threefold plan: error: --calibrate-ranks: must be >= 2", file=sys.stderr)
        return 2
    record = calibrate(args.calibrate_ranks)
    path = save(record, args.calibrate_out or DEFAULT_PATH)
    print(f"saved {path}; use it with: threefold plan --hardware-file {path} --gpus N "
          f"--gpus-per-node N (N processes on this machine)")
    return 0


def main(argv: list[str]) -> int:
    """``threefold plan ...``: print the top layouts (table or --json). Exit 0 on success,
    1 when no layout fits, 2 on bad input (one line on stderr). ``--calibrate`` measures this
    machine instead (see ``threefold.plan.calibrate``)."""
    try:
        args = build_parser().parse_args(argv)
        if args.calibrate:
            return _calibrate(args)
        cfg, cluster, work, space = _setup(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (UsageError, ConfigError, ValueError) as e:
        print(f"threefold plan: error: {e}", file=sys.stderr)
        return 2
    if args.max_seq_len:
        return print_longest(args, cfg, cluster, work, space)
    cpu = time.process_time()
    result = search(cfg, cluster, work, space, keep=args.top)
    cpu = time.process_time() - cpu
    top = result.ranked[:args.top]
    if args.json:
        print(json.dumps(to_json_rows(top), indent=1))
    else:
        _print_table(args, cfg, cluster, work, result, cpu)
    if not result.fits:
        print("threefold plan: no layout fits; " + (summary_lines(result).splitlines() or [""])[0],
              file=sys.stderr)
        return 1
    return 0


def _print_table(args, cfg: ModelConfig, cluster: Cluster, work: Workload, result, cpu):
    """The text report: the model, the cluster, the top layouts, the notes."""
    top = result.ranked[:args.top]
    hw = cluster.hardware
    fp8 = "" if work.fp8 == "none" else f" + fp8 {work.fp8} ({hw.peak_flops_fp8 / 1e12:.0f} TF/s)"
    moe = (f" ({count_text(active_parameters(cfg))} active: {cfg.num_local_experts} experts,"
           f" top-{cfg.num_experts_per_tok})" if cfg.num_local_experts else "")
    print(f"{args.model}: {count_text(num_parameters(cfg))} parameters{moe}, vocab "
          f"{cfg.vocab_size} (padded to a multiple of tp), "
          f"seq {work.seq_len}, {work.global_batch} sequences per step, {work.precision}{fp8}")
    print(f"{cluster.num_gpus} x {hw.name} ({cluster.gpus_per_node} per node): peak "
          f"{(hw.peak_flops(work.precision) or 0) / 1e12:.0f} TF/s, "
          f"{hw.memory_bytes / 1e9:.0f} GB, NVLink {hw.intra_node_bw * 2 / 1e9:.0f} GB/s, "
          f"network {hw.inter_node_bw * 8 / 1e9:.0f} Gb/s per GPU")
    if cluster.levels:
        print("network levels: " + "; ".join(
            f"{lv.name} {lv.gpus or cluster.num_gpus} GPUs, "
            f"{lv.bandwidth * 8 / 1e9:.0f} Gb/s per GPU"
            + (f" 1:{lv.oversubscription:g}" if lv.oversubscription > 1 else "")
            for lv in cluster.levels))
    print(f"{result.fits} layouts fit (searched in {cpu:.1f} s of CPU); top {len(top)} by "
          "predicted step time:")
    if top:
        print(format_table(top, explain_all=args.explain, moe=bool(cfg.num_local_experts),
                           interval=lambda c: layout_interval(
                               cfg, c.layout, c.step.step_time_s, cluster.num_gpus,
                               args.mtbf_hours, args.write_gbps)))
    if summary := summary_lines(result):
        print(summary)
    notes = result.notes + moe_notes(cfg, top, work)
    if cluster.mesh_order != "threefold":
        notes.append(f"mesh order {cluster.mesh_order}: not threefold's runtime's (pp, "
                     "dp_replicate, dp_shard, cp, tp outermost first); for comparing "
                     "with a published run")
    if work.block != "threefold":
        notes.append(f"activations of a {work.block} block, not threefold's own "
                     "(which keeps more: its sub-layer inputs whole under sequence "
                     "parallelism, the RoPE tables)")
    for note in notes:
        print(f"note: {note}")
