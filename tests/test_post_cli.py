"""The post-training launcher (``threefold.commands.posttrain``) imports a task's module only once its
command is chosen: parsing ``threefold sft``'s arguments loads no trainer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from threefold.commands import posttrain as cli


def test_parsing_arguments_loads_only_the_chosen_task():
    code = """
import sys
from threefold.commands import posttrain as cli
def loaded():
    return {"threefold.training.train", "threefold.post.grpo", "threefold.post.reward"} & set(sys.modules)
assert not loaded(), loaded()
opts, rest = cli.parse_task_options("sft", ["--sft.data", "x.jsonl", "--a.b", "1"])
assert opts.data == "x.jsonl" and rest == ["--a.b", "1"]
assert not loaded(), loaded()
assert cli.task_class("grpo").__name__ == "GRPOTask"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_command_has_its_options_and_task():
    names = {cmd: (cli.options_class(cmd).__name__, cli.task_class(cmd).__name__)
             for cmd in cli.TASKS}
    assert names == {"sft": ("SFTOptions", "SFTTask"), "dpo": ("DPOOptions", "DPOTask"),
                     "reward": ("RewardOptions", "RewardTask"),
                     "grpo": ("GRPOOptions", "GRPOTask")}
    assert all(dataclasses.is_dataclass(cli.options_class(cmd)) for cmd in cli.TASKS)
    with pytest.raises(ValueError, match="dpo.nope: unknown option"):
        cli.parse_task_options("dpo", ["--dpo.nope", "1"])
