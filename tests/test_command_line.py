"""The command line behaves like a Unix tool: every command's --help prints its usage and
exits 0, and output cut short by its reader (`| head`) ends without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from threefold.commands.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.parametrize("cmd", ["", *(c.name for c in COMMANDS)])
def test_every_help_prints_its_usage_and_exits_0(cmd, capsys):
    argv = [cmd, "--help"] if cmd else ["--help"]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's --help
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(f"usage: threefold {cmd or '<command>'}"), out[:200]
    assert len(out.splitlines()) >= 3  # more than the usage line: what it does, its options


def test_options_into_a_closed_pipe_ends_quietly():
    """`threefold options` whose reader has already gone (the pipe's read end closed before
    the first write, so the outcome does not race): no traceback, no "Exception ignored",
    status 128 + SIGPIPE. Then the issue's own `threefold options | head -1`."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "threefold", "options"], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=ENV)
    finally:
        os.close(write)
    assert p.stderr == ""
    assert p.returncode == 128 + signal.SIGPIPE
    shell = subprocess.run(f"'{sys.executable}' -m threefold options | head -1", shell=True,
                           capture_output=True, text=True, env=ENV)
    assert shell.returncode == 0 and shell.stderr == ""
    assert shell.stdout.startswith("--model.preset ") and shell.stdout.count("\n") == 1


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    """Only a closed standard output ends quietly: a BrokenPipeError from elsewhere (a socket,
    another pipe) while stdout is fine still propagates."""
    def boom(argv):
        raise BrokenPipeError("a socket")

    monkeypatch.setattr("threefold.commands.main.cmd_options", boom)
    with pytest.raises(BrokenPipeError):
        main(["options"])
