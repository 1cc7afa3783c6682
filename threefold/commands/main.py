"""`threefold <command> [args]` — a thin entry point.

The commands are one table, ``COMMANDS`` (name, arguments, what it does, the function that
runs it), which the help text, the dispatch and the unknown-command message all read: train,
sft, dpo, reward, grpo, plan, schedule, convert, generate, data, plot, options. A command's
module is imported when that command runs, so `threefold options` or `threefold plan` never
loads the trainer.

Bad input becomes one line on stderr and exit code 2, before any process starts and before
anything is written to the output directory. Output piped into a reader that stops early
(`head`, a pager) ends the command quietly, as it ends a Unix tool.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
from typing import NamedTuple

from threefold.config import ConfigError, describe, parse_overrides
from threefold.launch.launcher import (check_launch, cluster_launcher, dispatch, fail, load_run_config,
                              resolve_init_from, run_training, split_train_args)


class Command(NamedTuple):
    """One `threefold` command: ``args`` as the help shows them, ``help`` what it does, and
    ``target``, the "module:function" that runs it (argv -> exit code)."""

    name: str
    args: str
    help: str
    target: str


_POST = "[CONFIG.toml] [--section.key value ...] [--{0}.KEY VALUE ...] [--nproc-per-node N]"
COMMANDS = (
    Command("train", "[CONFIG.toml] [--section.key value ...] [--nproc-per-node N]",
            "train (N > 1 starts torchrun with N local processes)", "threefold.commands.main:cmd_train"),
    Command("sft", _POST.format("sft"), "supervised fine-tuning on chat conversations (after "
            "`threefold train`)", "threefold.commands.posttrain:sft_main"),
    Command("dpo", _POST.format("dpo"), "direct preference optimisation on "
            "prompt/chosen/rejected pairs", "threefold.commands.posttrain:dpo_main"),
    Command("reward", _POST.format("reward"), "a reward model (score head, Bradley-Terry loss) "
            "on the same pairs", "threefold.commands.posttrain:reward_main"),
    Command("grpo", _POST.format("grpo"), "GRPO: sample, reward, update (built-in task: sums "
            "of two digits)", "threefold.commands.posttrain:grpo_main"),
    Command("plan", "...", "rank parallel layouts for a model and cluster (threefold plan "
            "--help)", "threefold.commands.planning:main"),
    Command("schedule", "...", "check and simulate a pipeline schedule (threefold schedule "
            "--help)", "threefold.parallel.pipeline.command:main"),
    Command("convert", "--to hf CKPT OUT | --to peft [--merge] RUN OUT | --from hf HF_DIR "
            "OUT", "Hugging Face export / import; a LoRA run's adapters for PEFT, or merged",
            "threefold.commands.convert:main"),
    Command("generate", "--from RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] "
            "...", "complete prompts with a run's model (KV cache); prints tokens/s",
            "threefold.generation.generate:main"),
    Command("data", "prepare SOURCES... --out DIR [--tokenizer T.json] [--workers N] ...",
            "tokenize local text, JSON lines, Parquet, Arrow or saved datasets into token "
            "shards (resumable)", "threefold.data.prepare:main"),
    Command("plot", "RUN_DIR [RUN_DIR...] --out FILE.png", "draw runs' loss, lr, norm, tokens/s, "
            "MFU, memory against step", "threefold.commands.plot:main"),
    Command("options", "", "list every configuration option with its default and meaning",
            "threefold.commands.main:cmd_options"),
)
MULTI_NODE_HELP = """on several nodes, the same command on each (torchrun's c10d rendezvous):
  --nnodes N --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id ID] [--max-restarts K]
  [--rdzv-backend c10d|static] [--rdzv-conf join_timeout=900]
inside a Slurm allocation (one srun task per node) --nproc-per-node G alone: --nnodes,
  --node-rank, --rdzv-endpoint (first host, port 29500 or $THREEFOLD_RDZV_PORT) and --rdzv-id
  come from SLURM_*; flags given win (docs/launching.md)
"""
HELP_COLUMN = 21  # where each command's description starts


def usage_lines(cmd: Command) -> list[str]:
    """The help text's lines for ``cmd``: its name and arguments, then what it does, on the
    same line when they leave room for it."""
    head = f"  {cmd.name} {cmd.args}".rstrip()
    if len(head) < HELP_COLUMN:
        return [head.ljust(HELP_COLUMN) + cmd.help]
    return [head, " " * HELP_COLUMN + cmd.help]


USAGE = "\n".join(["usage: threefold <command> [args]", "", "commands:",
                   *(line for cmd in COMMANDS for line in usage_lines(cmd))]) + "\n"


def cmd_train(argv: list[str]) -> int:
    """`threefold train`: validate everything, then train here or under torchrun."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: threefold train {COMMANDS[0].args}\n\n{COMMANDS[0].help}\n\n"
              f"{MULTI_NODE_HELP}\nrun `threefold options` for every --section.key")
        return 0
    try:
        path, rest, nproc, launcher = split_train_args(argv)
        launcher = cluster_launcher(nproc, launcher)
        cfg = load_run_config(path, parse_overrides(rest))
        argv = resolve_init_from(cfg, argv)
        world = check_launch(cfg, nproc, launcher)
    except (ConfigError, ValueError) as e:
        return fail(str(e))
    return dispatch(cfg, world, nproc, launcher, argv, ["threefold", "train"],
                    lambda: run_training(cfg))


def cmd_options(argv: list[str]) -> int:
    """Print every option with its default and doc."""
    if argv:
        print("usage: threefold options\n\nlist every configuration option (--section.key) "
              "with its default and meaning", file=sys.stdout if argv[0] in ("-h", "--help")
              else sys.stderr)
        return 0 if argv[0] in ("-h", "--help") else 2
    for name, default, doc in describe():
        print(f"--{name:<40} {default:<22} {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``threefold <command>``: run the ``COMMANDS`` entry's function. When the reader
    of standard output has gone (``threefold options | head``) the command ends quietly with
    128 + SIGPIPE, the status a Unix tool killed by the closed pipe has."""
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        if not _stdout_closed():  # another pipe or socket: a real error
            raise
        # nothing more can be said on stdout; /dev/null takes the interpreter's last flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll reports an error on
    it), so that a BrokenPipeError came from our output and not from a socket."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _dispatch(argv: list[str] | None) -> int:
    """Run ``threefold <command>``'s function; the help text for none or --help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    commands = {cmd.name: cmd for cmd in COMMANDS}
    if argv[0] not in commands:
        return fail(f"unknown command '{argv[0]}'; commands: {', '.join(commands)}")
    module, function = commands[argv[0]].target.split(":")
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
