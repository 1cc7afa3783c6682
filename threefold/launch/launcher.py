"""Launching a run: the command-line arguments shared by every training command (`train`,
`sft`, `dpo`, `reward`, `grpo`), the layout check before any process starts, and the re-launch
under torchrun. Below both ``threefold.commands.main`` and ``threefold.commands.posttrain``, which
import it (neither imports the other).

The trainer (and torch with it) is imported only when a run starts in this process
(``run_training``, ``world_from_env``, a dry run): the process that validates and hands a run
to torchrun stays small for the whole run, beside its workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from threefold.config import ConfigError, load_config
from threefold.layout import Layout, validate_layout
from threefold.launch.elastic import elastic_argv, elastic_env, replan_for_world
from threefold.launch.slurm import slurm_launch_flags
from threefold.comm.topology import Topology


def fail(msg: str) -> int:
    """Print ``msg`` as one error line on stderr; return exit code 2 (bad input)."""
    print(f"threefold: error: {msg}", file=sys.stderr)
    return 2


# torchrun's flags that `threefold train` passes on, each with its value: the multi-node ones
# (docs/launching.md; --rdzv-backend defaults to c10d with an endpoint, --rdzv-conf carries
# e.g. join_timeout=900 for nodes that start slowly) and restarts
TORCHRUN_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend",
                  "--rdzv-conf", "--max-restarts")


def split_train_args(argv: list[str]) -> tuple[str | None, list[str], int | None, list[str]]:
    """(config path, override args, nproc, extra torchrun args) from train's argv."""
    path, rest, nproc, launcher = None, [], None, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--nproc-per-node", "--nproc_per_node"):
            if i + 1 >= len(argv):
                raise ValueError(f"{a}: missing value")
            nproc, i = argv[i + 1], i + 2
            continue
        if a.startswith("--nproc-per-node=") or a.startswith("--nproc_per_node="):
            nproc, i = a.split("=", 1)[1], i + 1
            continue
        if a in TORCHRUN_FLAGS:
            if i + 1 >= len(argv):
                raise ValueError(f"{a}: missing value")
            launcher += [a, argv[i + 1]]
            i += 2
            continue
        if a == "--dry-run":
            rest += ["--train.dry_run", "true"]
            i += 1
            continue
        if i == 0 and not a.startswith("--"):
            path, i = a, i + 1
            continue
        rest.append(a)
        i += 1
    if nproc is not None:
        if not str(nproc).isdigit() or int(nproc) < 1:
            raise ValueError(f"--nproc-per-node: '{nproc}' is not a positive integer")
        nproc = int(nproc)
    return path, rest, nproc, launcher


def cluster_launcher(nproc: int | None, launcher: list[str]) -> list[str]:
    """``launcher`` with what a Slurm allocation implies (``threefold.launch.slurm``): when this
    process is to start torchrun (``--nproc-per-node`` given, not inside a worker), the
    flags the user left out are inferred from the allocation and said on the first line."""
    if nproc is None or "LOCAL_RANK" in os.environ:
        return launcher
    launcher, line = slurm_launch_flags(os.environ, launcher)
    if line:
        print(line, flush=True)
    return launcher


def world_size_for(nproc: int | None, launcher: list[str]) -> int:
    """The world size a run will have: torchrun's WORLD_SIZE inside a worker, else
    ``nproc`` (1 when not given) times ``--nnodes``."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    nnodes = 1
    if "--nnodes" in launcher:
        nnodes = int(launcher[launcher.index("--nnodes") + 1].split(":")[-1])
    return (nproc or 1) * nnodes


def node_span_warnings(cfg, world: int, nproc: int | None) -> list[str]:
    """Before launch, the trap the running job would warn of at start-up (``threefold.comm.topology``):
    tp or cp·tp groups across nodes, for the ``world`` ranks the flags ask for (torchrun
    numbers ranks node by node, ``nproc`` each). Empty on one node or inside a worker."""
    if nproc is None or "WORLD_SIZE" in os.environ or world <= nproc:
        return []
    planned = Topology(tuple(f"node {r // nproc}" for r in range(world)),
                       tuple(r % nproc for r in range(world)))
    return planned.warnings(Layout.from_config(cfg, world))


def check_launch(cfg, nproc: int | None, launcher: list[str]) -> int:
    """The world size the flags ask for, once the layout is checked for it (an error raises)
    and the nodes it would span are warned of on stderr: what every training command does
    before it dispatches."""
    world = world_size_for(nproc, launcher)
    if nproc and not cfg.parallel.gpus_per_node and "LOCAL_WORLD_SIZE" not in os.environ:
        cfg.parallel.gpus_per_node = nproc  # what each worker reads from LOCAL_WORLD_SIZE
    # an elastic worker checks the layout it was configured with: its own world is re-planned
    # when it starts (threefold.launch.elastic)
    check_launch_layout(cfg, cfg.parallel.elastic_world or world)
    for line in node_span_warnings(cfg, world, nproc):
        print(line, file=sys.stderr)
    return world


def resolve_init_from(cfg, argv: list[str]) -> list[str]:
    """A hub id in ``checkpoint.init_from``, resolved here, once per node before its ranks
    start (``threefold.weights.hub``: the download, and any error, happen before launch; a dry run
    fetches config.json alone). Returns ``argv`` with the snapshot's commit added, which the
    ranks read from the cache (and the run's config.json records)."""
    from threefold.weights.hub import hub_id, locate

    c = cfg.checkpoint
    if c.init_from_commit or hub_id(c.init_from) is None:
        return argv
    c.init_from_commit = locate(c.init_from, "checkpoint.init_from",
                                config_only=cfg.train.dry_run).commit
    return [*argv, "--checkpoint.init_from_commit", c.init_from_commit]


def load_run_config(path: str | None, overrides: list[tuple[str, str]]):
    """``threefold.config.load_config`` (every field checked), then the data the configuration
    names: prepared sources complete and sharing one tokenizer (read from their small index
    files), a ConfigError naming the field otherwise. Before any process starts."""
    cfg = load_config(path, overrides)
    # the data layer's check, which config (below it) cannot make; imported here, as the
    # command needs it, so that the launcher's other commands stay small
    from threefold.data import DataError
    from threefold.data.sources import check_prepared

    try:
        check_prepared(cfg.data.corpus, cfg.data.mix, cfg.data.tokenizer)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return cfg


def check_launch_layout(cfg, world_size: int) -> None:
    """Refuse an impossible layout before any process starts, for the model the run will
    build: the checkpoint's (``checkpoint.init_from``: its configuration alone is read; a
    run also needs its tokenizer), else the preset's with the tokenizer's vocabulary."""
    if cfg.checkpoint.init_from:
        # threefold.weights (and torch) only for a run that starts from weights
        from threefold.weights.model_source import choose_tokenizer, init_from_model

        mcfg, _, located = init_from_model(cfg)
        validate_layout(cfg, world_size, mcfg)
        if not cfg.train.dry_run:
            choose_tokenizer(cfg, located)
        return
    # the shape, but for the vocabulary (the tokenizer's, known once data is prepared)
    validate_layout(cfg, world_size, cfg.model.resolved(vocab_size=1))


LAUNCHER_FLAGS = ("--nproc-per-node", "--nproc_per_node", *TORCHRUN_FLAGS)


def torchrun_accepts(flag: str) -> bool:
    """Whether the installed torchrun knows ``flag`` (torch 2.11's has no --shutdown-timeout),
    read from its source without importing torch (the launcher stays small)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    run = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "run.py"
    try:
        return f'"{flag}"' in run.read_text()
    except OSError:
        return False


def launch(nproc: int, launcher: list[str], argv: list[str], target: list[str],
           grace_s: float = 0.0, output_dir: str | None = None) -> int:
    """Re-run ``python -m TARGET argv`` under torchrun (torch's own launcher, never a
    home-made one) with ``nproc`` local processes: launcher flags go to torchrun, the rest to
    each process.

    Preemption (``grace_s`` > 0): torchrun's shutdown timeout is set above the grace period,
    so the workers it forwards SIGTERM to have the time to save; a SIGTERM sent to this
    process goes on to torchrun; when the run then recorded a clean preemption (summary.json
    in ``output_dir`` written after the signal, with ``preempted``) the exit code is 0 — torchrun
    itself always fails after a signal."""
    skip_next, args = False, []
    for a in argv:
        if skip_next:
            skip_next = False
        elif a in LAUNCHER_FLAGS:
            skip_next = True
        elif not a.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            args.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if "--nnodes" not in launcher:
        cmd += ["--standalone"]
    elif "--rdzv-endpoint" in launcher and "--rdzv-backend" not in launcher:
        cmd += ["--rdzv-backend=c10d"]
    if grace_s > 0 and not any(a.startswith("--shutdown") for a in launcher) \
            and torchrun_accepts("--shutdown-timeout"):
        cmd += [f"--shutdown-timeout={int(grace_s) + 15}"]
    proc = subprocess.Popen(cmd + launcher + ["-m", *target] + args, env=elastic_env(launcher))
    signalled: list[float] = []

    def forward(signum, _frame):
        signalled.append(time.time())
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if rc and signalled and output_dir and _preempted_since(Path(output_dir), signalled[0]):
        return 0
    return rc


def _preempted_since(out: Path, t0: float) -> bool:
    """Whether the run in ``out`` stopped cleanly on a preemption notice after time ``t0``."""
    path = out / "summary.json"
    try:
        return path.stat().st_mtime >= t0 - 1 and "preempted" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def dispatch(cfg, world: int, nproc: int | None, launcher: list[str], argv: list[str],
             target: list[str], run, rows_per_item: int = 1, task_data=None) -> int:
    """After validation: a dry run (``rows_per_item``: sequences each batch item puts through
    the model; ``task_data``: a post-training task's records, ``plan.baseline.TaskData``), or a
    re-launch under torchrun, or ``run()`` here."""
    if cfg.train.dry_run:
        from threefold.launch.dryrun import dry_run  # the model and torch: see the docstring

        try:
            return dry_run(cfg, world, rows_per_item=rows_per_item, task=task_data)
        except (ConfigError, ValueError) as e:
            return fail(str(e))
    if nproc is not None and "LOCAL_RANK" not in os.environ:
        argv = elastic_argv(cfg, nproc, launcher, argv)
        return launch(nproc, launcher, argv, target, cfg.train.preemption_grace_s,
                      cfg.train.output_dir)
    return run()


def run_training(cfg, make_task=None) -> int:
    """Train ``cfg`` in this process, on the task ``make_task()`` builds (None: pre-training);
    a configuration, data or checkpoint error becomes one line on stderr and exit code 2."""
    # the trainer and torch, imported only here: see the module docstring
    from threefold.weights.checkpoint_verify import CheckpointError
    from threefold.data import DataError
    from threefold.training.train import train

    try:
        task = make_task() if make_task is not None else None
        train(cfg, world_from_env(cfg), task=task)
    except (ConfigError, DataError, CheckpointError) as e:
        return fail(str(e))
    return 0


def world_from_env(cfg):
    """The layout of this process: ``Distributed`` under torchrun (WORLD_SIZE > 1), else one
    process (which under torchrun knows its restarts: a restarted run resumes); one replica
    group of several under ``ft.lighthouse``. Under an elastic launch a world of another size
    first re-plans ``cfg``'s layout (``threefold.launch.elastic``)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    line = replan_for_world(cfg, size)
    if line and os.environ.get("RANK", "0") == "0":
        print(f"threefold: {line}", flush=True)
    if size <= 1:
        from threefold.parallel.world import SingleProcess

        world = SingleProcess()
        world.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    else:
        # torch.distributed, imported only here: see the module docstring
        from threefold.parallel.distributed_world import Distributed

        world = Distributed(cfg)
    if cfg.ft.lighthouse:
        from threefold.parallel.ft_replicas import ReplicaWorld

        world = ReplicaWorld(world, cfg)
    return world
