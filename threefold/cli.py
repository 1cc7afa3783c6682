"""`threefold train | plan | schedule | launch` — a thin entry point.

Bad input becomes one line on stderr and exit code 2, before any process starts and before
anything is written to the output directory.
"""

from __future__ import annotations

import sys

from threefold.launch import (_check_layout, _fail, _run_training, _split_train_args,
                              _world_size_for, dispatch)

USAGE = """usage: threefold <command> [args]

commands:
  train [CONFIG.toml] [--section.key value ...] [--nproc-per-node N]
                     train (N > 1 starts torchrun with N local processes)
  sft [CONFIG.toml] [--section.key value ...] [--sft.KEY VALUE ...] [--nproc-per-node N]
                     supervised fine-tuning on chat conversations (after `threefold train`)
  dpo [CONFIG.toml] [--section.key value ...] [--dpo.KEY VALUE ...] [--nproc-per-node N]
                     direct preference optimisation on prompt/chosen/rejected pairs
  reward [CONFIG.toml] [--section.key value ...] [--reward.KEY VALUE ...] [--nproc-per-node N]
                     a reward model (score head, Bradley-Terry loss) on the same pairs
  grpo [CONFIG.toml] [--section.key value ...] [--grpo.KEY VALUE ...] [--nproc-per-node N]
                     GRPO: sample, reward, update (built-in task: sums of two digits)
  plan ...           rank parallel layouts for a model and cluster (threefold plan --help)
  schedule ...       check and simulate a pipeline schedule (threefold schedule --help)
  convert --to hf CKPT OUT | --from hf HF_DIR OUT
                     Hugging Face export / import
  generate --from RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] ...
                     complete prompts with a run's model (KV cache); prints tokens/s
  options            list every configuration option with its default and meaning
"""



def cmd_train(argv: list[str]) -> int:
    """`threefold train`: validate everything, then train here or under torchrun."""
    from threefold.config import ConfigError, load_config, parse_overrides

    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.splitlines()[3] + "\n\nrun `threefold options` for every --section.key")
        return 0
    try:
        path, rest, nproc, launcher = _split_train_args(argv)
        cfg = load_config(path, parse_overrides(rest))
        world = _world_size_for(nproc, launcher)
        _check_layout(cfg, world)
    except (ConfigError, ValueError) as e:
        return _fail(str(e))
    return dispatch(cfg, world, nproc, launcher, argv, ["threefold", "train"],
                    lambda: _run_training(cfg))



def cmd_options(argv: list[str]) -> int:
    """Print every option with its default and doc."""
    from threefold.config import describe

    for name, default, doc in describe():
        print(f"--{name:<40} {default:<22} {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``threefold <command>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return cmd_train(rest)
    if cmd == "options":
        return cmd_options(rest)
    if cmd == "plan":
        from threefold.plan.cli import main as plan_main

        return plan_main(rest)
    if cmd in ("sft", "dpo"):
        from threefold.post.cli import dpo_main, sft_main

        return sft_main(rest) if cmd == "sft" else dpo_main(rest)
    if cmd in ("reward", "grpo"):
        from threefold.post.cli import grpo_main, reward_main

        return reward_main(rest) if cmd == "reward" else grpo_main(rest)
    if cmd == "generate":
        from threefold.generate import main as generate_main

        return generate_main(rest)
    if cmd == "convert":
        from threefold.hf import main as convert_main

        return convert_main(rest)
    if cmd == "schedule":
        from threefold.parallel.pipeline.command import main as schedule_main

        return schedule_main(rest)
    return _fail(f"unknown command '{cmd}'; commands: train, sft, dpo, reward, grpo, plan, schedule, convert, generate, options")


if __name__ == "__main__":
    sys.exit(main())
