"""`threefold sft`, `threefold dpo`, `threefold reward` and `threefold grpo`: the `train`
command with a post-training Task.

Both take what `train` takes, ``[CONFIG.toml] [--section.key value ...] [--nproc-per-node N]``,
plus their own ``--sft.KEY VALUE`` / ``--dpo.KEY VALUE`` options (``SFTOptions``,
``DPOOptions``). Their defaults differ from `train`'s where post-training needs it (start from
``runs/default``, the output of a plain ``threefold train``; the built-in example data; a few
dozen steps; output in ``runs/sft`` / ``runs/dpo``); a TOML file or an override still wins.
Bad input is one line on stderr and exit code 2, before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import tomllib
import typing
from pathlib import Path
from types import ModuleType

from threefold.config import ConfigError, parse_overrides, take_flag
from threefold.data import DataError
from threefold.layout import task_layout
from threefold.post.inputs import task_data
from threefold.launch.launcher import (check_launch, cluster_launcher, dispatch, fail, load_run_config,
                              resolve_init_from, run_training, split_train_args)

_COMMON = {"train.steps": "30", "optim.warmup_steps": "3", "optim.weight_decay": "0.0",
           "train.eval_batches": "1", "train.log_interval": "5",
           # a fine-tune's resident set follows its live tensors, as the dry run predicts
           # (threefold.training.hostmem): one process keeping freed blocks below 256 MiB ran
           # SmolLM2-135M's LoRA SFT 1.5-1.7x faster but held 6.0 GB against 3.6 predicted
           "train.host_mmap_threshold_mb": "1"}
DEFAULTS = {
    # sft packs conversations into rows with attention kept inside each (document ids): the
    # configuration says so, which the dry run's memory counts
    "sft": dict(_COMMON, **{"checkpoint.init_from": "runs/default",
                            "train.output_dir": "runs/sft", "optim.lr": "3e-4",
                            "data.document_mask": "true"}),
    "dpo": dict(_COMMON, **{"checkpoint.init_from": "runs/default",
                            "train.output_dir": "runs/dpo", "optim.lr": "1e-4"}),
    "reward": dict(_COMMON, **{"checkpoint.init_from": "runs/default",
                               "train.output_dir": "runs/reward", "optim.lr": "1e-4"}),
    "grpo": dict(_COMMON, **{"checkpoint.init_from": "runs/default",
                             "train.output_dir": "runs/grpo", "optim.lr": "3e-4",
                             "train.steps": "50", "train.global_batch_size": "32",
                             "train.micro_batch_size": "32", "data.seq_len": "64",
                             "optim.warmup_steps": "0", "checkpoint.interval": "25"}),
}
# sequences each item of a batch puts through the model: a pair's chosen and rejected rows
ROWS_PER_ITEM = {"dpo": 2, "reward": 2}
# command -> (its module, options class, Task class). A task's module (and with it the trainer,
# for reward and grpo) is imported only once its command is chosen, so the launcher loads no
# more than that command needs to parse its arguments.
TASKS = {"sft": ("threefold.post.sft", "SFTOptions", "SFTTask"),
         "dpo": ("threefold.post.dpo", "DPOOptions", "DPOTask"),
         "reward": ("threefold.post.reward", "RewardOptions", "RewardTask"),
         "grpo": ("threefold.post.grpo", "GRPOOptions", "GRPOTask")}
USAGE = """usage: threefold {cmd} [CONFIG.toml] [--section.key value ...] [--{cmd}.KEY VALUE ...]
                     [--nproc-per-node N]

{what}
Defaults that differ from `threefold train`: {defaults}
Options of this command:
{options}
Run `threefold options` for every --section.key."""
WHAT = {"sft": "Supervised fine-tuning on chat conversations (assistant tokens only).",
        "dpo": "Direct preference optimisation on prompt/chosen/rejected pairs.",
        "reward": "A reward model (score head, Bradley-Terry loss) on prompt/chosen/rejected "
                  "pairs.",
        "grpo": "Group relative policy optimisation: G sampled completions per prompt, "
                "rewarded, group-normalised advantages, clipped ratio, KL to the initial "
                "policy."}
DOCS = {
    "data": "JSONL file; empty = the built-in examples",
    "val_data": "validation JSONL; empty = the last data.val_fraction of --{cmd}.data",
    "chat_template": "auto (the tokenizer's, else built-in), builtin, or a .jinja file",
    "beta": "strength of the pull towards the reference (GRPO: weight of the KL)",
    "label_smoothing": "conservative-DPO epsilon in [0, 0.5): assumed share of flipped labels",
    "loss_type": "DPO: sigmoid, ipo or hinge (TRL's); GRPO: grpo, bnpo, dr_grpo or dapo",
    "center_rewards_coefficient": "weight of (r_chosen + r_rejected)^2 in the loss (TRL's)",
    "prompts": "JSONL of {{\"prompt\": ..., other columns}}; empty = built-in sums (a+b=)",
    "val_prompts": "validation JSONL; empty = the last data.val_fraction of the prompts",
    "reward": "arithmetic (built-in), file.py:function or module:function; empty = none",
    "reward_model": "a `threefold reward` run whose score is added to the reward",
    "num_generations": "G: completions per prompt (global_batch_size counts completions)",
    "max_completion_length": "new tokens per completion at most",
    "temperature": "sampling temperature (log-probs are of logits / temperature)",
    "top_p": "nucleus sampling mass", "top_k": "top-k sampling (0 = no limit)",
    "kl_bias_correction": "weigh the KL term by the policy ratio (TRL's default)",
    "epsilon": "clipping range of the policy ratio",
    "num_iterations": "optimiser steps per generation batch (ratio against the sampling policy)",
    "scale_rewards": "group, batch or none: what the advantages are divided by",
    "shuffle": "prompts in a new order each epoch (false: file order)",
    "rollout_engine": "builtin (the training model generates) or vllm (docs/post-training.md)",
    "vllm_kv_cache_mb": "vllm: the engine's KV cache per rank, MiB",
    "importance_sampling": "vllm: token_truncate, sequence_mask or none (engine vs trainer)",
    "importance_sampling_cap": "vllm: the importance ratio's cap",
    "max_staleness": "vllm: >= 1 generates step s+1 while step s trains (1 step stale)",
    "vllm_mode": "vllm: colocate (an engine per rank) or server (one engine process)",
    "vllm_server": "vllm server mode: host:port of a running server; empty = start one",
    "vllm_server_tp": "vllm server mode: the server engine's tensor parallelism (processes)",
}


def _module(cmd: str) -> ModuleType:
    """The module of ``cmd``'s task, imported now."""
    return importlib.import_module(TASKS[cmd][0])


def options_class(cmd: str) -> type:
    """``cmd``'s options dataclass (``SFTOptions``...)."""
    return getattr(_module(cmd), TASKS[cmd][1])


def task_class(cmd: str) -> type:
    """``cmd``'s Task class (``SFTTask``...)."""
    return getattr(_module(cmd), TASKS[cmd][2])


def _usage(cmd: str) -> str:
    opts = "\n".join(f"  --{cmd}.{f.name:<16} {f.default!r:<8} {DOCS[f.name].format(cmd=cmd)}"
                     for f in dataclasses.fields(options_class(cmd)))
    defaults = ", ".join(f"{k}={v}" for k, v in DEFAULTS[cmd].items())
    return USAGE.format(cmd=cmd, what=WHAT[cmd], defaults=defaults, options=opts)


def parse_task_options(cmd: str, argv: list[str]):
    """(options dataclass, the remaining argv) with every ``--{cmd}.KEY VALUE`` (or
    ``--{cmd}.KEY=VALUE``) taken out; ValueError for an unknown key or a bad value."""
    cls = options_class(cmd)
    hints = typing.get_type_hints(cls)
    values, rest, i = {}, [], 0
    prefix = f"--{cmd}."
    while i < len(argv):
        a = argv[i]
        if not a.startswith(prefix):
            rest.append(a)
            i += 1
            continue
        key, value, i = take_flag(argv, i)
        key = key[len(cmd) + 1:]
        if key not in hints:
            raise ValueError(f"{cmd}.{key}: unknown option; options: "
                             + ", ".join(f.name for f in dataclasses.fields(cls)))
        try:
            if hints[key] is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                values[key] = value.lower() in ("true", "1")
            else:
                values[key] = hints[key](value)
        except ValueError:
            raise ValueError(f"{cmd}.{key}: '{value}' is not a valid "
                             f"{hints[key].__name__}") from None
    return cls(**values), rest


def _user_keys(path: str | None, overrides: list[tuple[str, str]]) -> set[str]:
    """The dotted keys the config file and the overrides set (so our defaults stay out)."""
    keys = {k for k, _ in overrides}
    if path and Path(path).is_file():
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError:
            return keys  # load_config reports it
        keys |= {f"{s}.{k}" for s, t in data.items() if isinstance(t, dict) for k in t}
    return keys


def build_config(cmd: str, path: str | None, rest: list[str]):
    """The validated Config: `train`'s defaults <- this command's <- file <- overrides."""
    overrides = parse_overrides(rest)
    user = _user_keys(path, overrides)
    # load_config applies the file before the overrides, so our defaults (which must lose to
    # the file) go in as overrides only for keys the file does not set.
    ours = [(k, v) for k, v in DEFAULTS[cmd].items() if k not in user]
    return load_run_config(path, ours + overrides)


def _check_default_start(cmd: str, cfg) -> None:
    """The default ``checkpoint.init_from`` (runs/default, which `threefold train` writes)
    missing: say so, rather than look for a hub model of that name."""
    src = cfg.checkpoint.init_from
    if src == DEFAULTS[cmd]["checkpoint.init_from"] and not Path(src).exists():
        raise ConfigError(f"checkpoint.init_from: '{src}' does not exist; run `threefold "
                          "train` first (it writes runs/default), or pass "
                          "--checkpoint.init_from RUN_DIR|HF_DIR|org/name (or '' to start "
                          "from random weights)")


def _check_inputs(cmd: str, cfg, opts) -> None:
    """Refuse missing inputs before any process starts."""
    if cmd == "sft" and not cfg.data.document_mask:
        raise ConfigError("data.document_mask: sft always keeps attention inside each packed "
                          "conversation; leave it true")
    for key in ("data", "val_data"):
        value = getattr(opts, key, "")
        if value and not Path(value).expanduser().is_file():
            raise ConfigError(f"{cmd}.{key}: '{value}' is not a file")
    task_cls, mod = task_class(cmd), _module(cmd)
    if cmd == "dpo":
        task_cls(opts)  # checks beta and label smoothing
        task_layout(cmd, cfg)  # the rule book's refusals for this task
    if cmd == "grpo":
        for key in ("prompts", "val_prompts", "reward_model"):
            value = getattr(opts, key)
            if value and not Path(value).expanduser().exists():
                raise ConfigError(f"grpo.{key}: '{value}' does not exist")
        task = task_cls(opts)  # the options, the reward function loaded
        task.check(cfg)  # layout and batch
        if task.reward_fn is not None:  # called on probes: raises, wrong count, NaN
            rewards = importlib.import_module("threefold.post.grpo_rewards")
            rewards.check_reward_function(task.reward_fn, opts.reward,
                                          rewards.prompt_records(opts.prompts)[0])
    if cmd == "reward":
        task_cls(opts).check_layout(cfg)  # and the options
        for key in ("data", "val_data"):  # every rank would fail on it after launch
            if getattr(opts, key):
                mod.check_pairs_file(str(Path(getattr(opts, key)).expanduser()))


def _main(cmd: str, argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(_usage(cmd))
        return 0
    try:
        opts, remaining = parse_task_options(cmd, argv)
        path, rest, nproc, launcher = split_train_args(remaining)
        launcher = cluster_launcher(nproc, launcher)
        cfg = build_config(cmd, path, rest)
        _check_default_start(cmd, cfg)
        argv = resolve_init_from(cfg, argv)
        world = check_launch(cfg, nproc, launcher)
        _check_inputs(cmd, cfg, opts)
    except (ConfigError, DataError, ValueError) as e:
        return fail(str(e))
    return dispatch(cfg, world, nproc, launcher, argv, ["threefold.commands.posttrain", cmd],
                    lambda: run_training(cfg, lambda: task_class(cmd)(opts)),
                    ROWS_PER_ITEM.get(cmd, 1),
                    task_data(cmd, opts, ROWS_PER_ITEM.get(cmd, 1)))


def sft_main(argv: list[str]) -> int:
    """`threefold sft [CONFIG.toml] [--section.key value ...] [--sft.KEY VALUE ...]
    [--nproc-per-node N]`; returns the exit code."""
    return _main("sft", list(argv))


def dpo_main(argv: list[str]) -> int:
    """`threefold dpo [CONFIG.toml] [--section.key value ...] [--dpo.KEY VALUE ...]
    [--nproc-per-node N]`; returns the exit code."""
    return _main("dpo", list(argv))


def reward_main(argv: list[str]) -> int:
    """`threefold reward [CONFIG.toml] [--section.key value ...] [--reward.KEY VALUE ...]
    [--nproc-per-node N]`; returns the exit code."""
    return _main("reward", list(argv))


def grpo_main(argv: list[str]) -> int:
    """`threefold grpo [CONFIG.toml] [--section.key value ...] [--grpo.KEY VALUE ...]
    [--nproc-per-node N]`; returns the exit code."""
    return _main("grpo", list(argv))


def main(argv: list[str] | None = None) -> int:
    """``python -m threefold.commands.posttrain sft|dpo|reward ...`` (what torchrun runs for these
    commands)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in TASKS:
        print("usage: python -m threefold.commands.posttrain sft|dpo|reward|grpo [args]", file=sys.stderr)
        return 2
    return _main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
