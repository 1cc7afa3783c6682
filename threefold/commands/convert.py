"""`threefold convert`: a run's checkpoints to and from Hugging Face folders, and a LoRA run's
adapters for PEFT. The command only parses its arguments and calls the libraries:
``threefold.weights.hf`` (``export_hf``, ``convert_from_hf``) and
``threefold.generation.peft_export`` (``export_peft``, ``export_merged``), so neither library
imports the other for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from threefold.weights.checkpoint_verify import CheckpointError
from threefold.config import ConfigError
from threefold.weights.hf import convert_from_hf, export_hf
from threefold.weights.hub import locate
from threefold.generation.peft_export import export_merged, export_peft

USAGE = """usage: threefold convert --to hf CKPT OUT      checkpoint (or run dir) -> HF folder
       threefold convert --to peft RUN OUT     LoRA run (or checkpoint) -> PEFT adapter
       threefold convert --to peft --merge RUN OUT
                                               LoRA run -> HF folder, adapters merged
       threefold convert --from hf HF_DIR OUT  HF folder -> threefold run dir OUT"""

FORMATS = {"to": ("hf", "peft"), "from": ("hf",)}


def _parse(argv: list[str]) -> tuple[str, str, bool, str, str]:
    """(direction 'to'/'from', format 'hf'/'peft', --merge, source, destination) or
    ValueError."""
    args, direction, fmt, merge = [], None, "", False
    i = 0
    while i < len(argv):
        a = argv[i]
        key, _, val = a[2:].partition("=")
        if a == "--merge":
            merge = True
        elif a.startswith("--") and key in FORMATS:
            if not val:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key}: missing format ({'/'.join(FORMATS[key])})")
                val, i = argv[i + 1], i + 1
            if val not in FORMATS[key]:
                raise ValueError(f"--{key}: unknown format '{val}'; one of "
                                 f"{', '.join(FORMATS[key])}")
            if direction:
                raise ValueError("give one of --to hf / --to peft / --from hf")
            direction, fmt = key, val
        elif a.startswith("-"):
            raise ValueError(f"unknown option '{a}'")
        else:
            args.append(a)
        i += 1
    if direction is None:
        raise ValueError("give --to hf or --to peft (export) or --from hf (import)")
    if merge and (direction, fmt) != ("to", "peft"):
        raise ValueError("--merge goes with --to peft (a LoRA run's adapters merged)")
    if len(args) != 2:
        raise ValueError(f"expected a source and a destination, got {len(args)} path(s)")
    return direction, fmt, merge, args[0], args[1]


def main(argv: list[str]) -> int:
    """``threefold convert`` (``argv`` after the word ``convert``); 0 on success, 2 with one
    line on stderr for bad input."""
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        direction, fmt, merge, src, dst = _parse(argv)
        if direction == "from":  # a folder, or a hub id (threefold.weights.hub: fetched first)
            ckpt = convert_from_hf(locate(src, "convert --from hf").path, Path(dst))
            print(f"threefold convert: wrote threefold checkpoint {ckpt}")
        elif fmt == "hf":
            export_hf(Path(src), Path(dst))
            print(f"threefold convert: wrote Hugging Face folder {dst}")
        else:
            (export_merged if merge else export_peft)(Path(src), Path(dst))
            what = "Hugging Face folder (LoRA merged)" if merge else "PEFT adapter"
            print(f"threefold convert: wrote {what} {dst}")
    except (ValueError, CheckpointError, ConfigError, OSError) as e:
        msg = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"threefold convert: error: {msg}", file=sys.stderr)
        return 2
    return 0
