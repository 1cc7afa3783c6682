"""Multi-node launch the way clusters do it: the Slurm node list read as scontrol prints it,
the torchrun flags an allocation implies (explicit flags win), each rank's node learnt at
start-up and tp/cp across nodes flagged; and two launcher agents on 127.0.0.1 in a faked
two-node Slurm allocation training to the single process's losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import metrics, tiny_overrides
from tests.dist import run_checks
from tests.test_launch import _args, _env, _free_port, wait_agents
from threefold.config import load_config
from threefold.layout import Layout
from threefold.launch.slurm import PORT_ENV, expand_hostlist, slurm_launch_flags
from threefold.comm.topology import TEST_HOSTNAME_ENV, Topology

HOSTLISTS = [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-003]-ib", ["gpu-001-ib", "gpu-002-ib", "gpu-003-ib"]),
    ("node[8-10]", ["node8", "node9", "node10"]),       # no padding: widths grow
    ("node[08-10]", ["node08", "node09", "node10"]),    # the lower bound's padding kept
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[3],y[1-2,5]z,w", ["x3", "y1z", "y2z", "y5z", "w"]),
    ("127.0.0.1,127.0.0.1", ["127.0.0.1", "127.0.0.1"]),
]


@pytest.mark.parametrize("text,hosts", HOSTLISTS)
def test_hostlist_forms_slurm_prints(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,needle", [
    ("node[01-04", "unbalanced"), ("node]1[", "unbalanced"), ("n[[1]]", "unbalanced"),
    ("node[a-b]", "not numbers"), ("node[5-2]", "backwards"), ("a,,b", "empty name"),
    ("", "empty"),
])
def test_hostlist_refuses_what_slurm_never_prints(text, needle):
    with pytest.raises(ValueError, match=needle):
        expand_hostlist(text)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu-[001-004]-ib"}


def _by_parser(nodelist):
    return expand_hostlist(nodelist), "parser"


def test_slurm_allocation_gives_the_launcher_flags():
    flags, line = slurm_launch_flags(SLURM, [], _by_parser)
    assert flags == ["--nnodes", "4", "--rdzv-endpoint", "gpu-001-ib:29500", "--rdzv-id",
                     "slurm4242"]
    assert line.startswith("threefold: Slurm job 4242, node 2: --nnodes 4") \
        and "by parser" in line
    # the static rendezvous takes the node's rank from the flag (c10d numbers nodes itself)
    flags, _ = slurm_launch_flags(SLURM, ["--rdzv-backend", "static"], _by_parser)
    assert flags[2:6] == ["--nnodes", "4", "--node-rank", "2"]
    # explicit flags win, one by one; the port is overridable; a step's own nodes first
    env = dict(SLURM, SLURM_STEP_NODELIST="gpu-[003-004]-ib", **{PORT_ENV: "31000"})
    flags, _ = slurm_launch_flags(env, ["--nnodes", "2", "--rdzv-id", "mine"], _by_parser)
    assert flags == ["--nnodes", "2", "--rdzv-id", "mine", "--rdzv-endpoint",
                     "gpu-003-ib:31000"]
    given = ["--nnodes", "1", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"]
    assert slurm_launch_flags(SLURM, given, _by_parser) == (given, None)
    assert slurm_launch_flags({}, ["--nnodes", "2"], _by_parser) == (["--nnodes", "2"], None)


@pytest.mark.parametrize("env,needle", [
    ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two'"),
    ({PORT_ENV: "99999"}, PORT_ENV),
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2"}, "--ntasks-per-node=1"),
])
def test_slurm_inference_refuses_in_one_line(env, needle):
    with pytest.raises(ValueError, match=needle):
        slurm_launch_flags(dict(SLURM, **env), [], _by_parser)


def test_topology_flags_tp_and_cp_across_nodes_only():
    two_by_two = Topology(("n1", "n1", "n2", "n2"), (0, 1, 0, 1))
    assert two_by_two.describe() == "2 nodes × 2 ranks"
    inside = Layout(dp_replicate=2, tp=2)
    assert two_by_two.warnings(inside) == []
    assert two_by_two.summary(inside) == {"nodes": 2, "ranks_per_node": [2, 2],
                                          "node_names": ["n1", "n2"], "axes_across_nodes": []}
    across = Layout(tp=4)
    [line] = two_by_two.warnings(across)
    assert line == ("threefold: warning: tp=4 spans nodes (ranks 0 on n1, 1 on n1, 2 on n2, "
                    "3 on n2; 1 of 1 tp groups): its traffic goes over the network; choose "
                    "parallel.tp dividing the 2 ranks of a node")
    cp = Layout(tp=1, cp=4)
    assert [w.split()[2] for w in two_by_two.warnings(cp)] == ["cp=4"]
    cp_tp = Layout(tp=2, cp=2)
    [line] = two_by_two.warnings(cp_tp)  # tp inside each node, cp across them
    assert line.startswith("threefold: warning: cp=2 spans nodes (ranks 0 on n1, 2 on n2; 2 of "
                           "2 cp groups)") and "parallel.cp × parallel.tp dividing" in line
    # a hybrid: Ulysses' all-to-all inside each node, the ring across them, as meant
    hybrid = Layout(cp=4, cp_ulysses=2)
    assert two_by_two.warnings(hybrid) == []
    assert two_by_two.summary(hybrid)["axes_across_nodes"] == ["cp_outer"]
    four_by_two = Topology(tuple(f"n{r // 2}" for r in range(8)), (0, 1) * 4)
    [line] = four_by_two.warnings(Layout(cp=4, cp_ulysses=2, tp=2))
    assert line.startswith("threefold: warning: cp_inner=2 spans nodes") and \
        "parallel.cp_ulysses × parallel.tp dividing" in line
    ragged = Topology(("a", "a", "a", "b"), (0, 1, 2, 0))
    assert ragged.describe() == "2 nodes (3+1 ranks)"


def _topology_on_node(rank, world, node_of_rank):
    """A rank that reports itself on ``node_of_rank[rank]``: what the layout learnt."""
    from threefold.config import Config, ParallelConfig
    from threefold.parallel.distributed_world import Distributed

    os.environ[TEST_HOSTNAME_ENV] = node_of_rank[rank]
    cfg = Config()
    cfg.parallel = ParallelConfig(tp=world, dp_shard=1)
    lay = Distributed(cfg)
    return lay.topology, lay.topology_lines()


def test_ranks_learn_their_nodes_at_start_up():
    """Through the layout itself: two ranks on one node, then on two (tp=2 both times)."""
    same, split = run_checks(2, [(_topology_on_node, (["n1", "n1"],)),
                                 (_topology_on_node, (["n1", "n2"],))])
    assert same[0][0] == same[1][0] == Topology(("n1", "n1"), (0, 1))
    assert same[0][1] == ["threefold: 2 ranks on 1 node × 2 ranks (n1: 2)"]
    assert split[0][0] == Topology(("n1", "n2"), (0, 1))
    assert len(split[0][1]) == 2 and "tp=2 spans nodes" in split[0][1][1]


@pytest.mark.slow
def test_two_nodes_from_a_slurm_allocation(corpus, cache_dir, tmp_path):
    """Two launcher agents on 127.0.0.1 in a faked two-node allocation (node list 127.0.0.1
    twice; each agent's ranks named node1/node2 by the test-only hostname): node 0 given the
    multi-node flags by hand (they win), node 1 only --nproc-per-node 1. They train tp=2
    across the two "nodes" to the single process's losses; each says first what it inferred,
    the run warns that tp spans nodes and records 2 nodes × 1 rank."""
    from threefold.training.train import train

    steps = 2
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(corpus, cache_dir, ref, train__steps=steps)))
    out, port, procs = tmp_path / "slurm", _free_port(), []
    job, endpoint = f"7{port}", f"127.0.0.1:{port}"
    by_hand = [["--nnodes", "2", "--rdzv-endpoint", endpoint], []]
    for node in range(2):
        env = dict(_env(), SLURM_JOB_ID=job, SLURM_NNODES="2", SLURM_NODEID=str(node),
                   SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", **{PORT_ENV: str(port)},
                   **{TEST_HOSTNAME_ENV: f"node{node + 1}"})
        cmd = [sys.executable, "-m", "threefold", "train", "--nproc-per-node", "1",
               *by_hand[node], *_args(corpus, cache_dir, out, train__steps=steps,
                                      parallel__tp=2)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        time.sleep(0.5)
    # no retry: a finished run exits 0 on every rank (threefold.comm.distributed.shutdown); a hang
    # is a failure, with both agents' output
    outs = wait_agents(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    reader = "scontrol" if shutil.which("scontrol") else "parser"
    win = "; flags given on the command line win"
    assert outs[0].splitlines()[0] == f"threefold: Slurm job {job}, node 0: --rdzv-id slurm{job}" \
        + win, outs[0]
    assert outs[1].splitlines()[0] == (
        f"threefold: Slurm job {job}, node 1: --nnodes 2 --rdzv-endpoint {endpoint} --rdzv-id "
        f"slurm{job} (first of 127.0.0.1,127.0.0.1, read by {reader})" + win), outs[1]
    log = "".join(outs)
    assert "threefold: 2 ranks on 2 nodes × 1 rank (node" in log, log[-3000:]
    # each launcher warns before torchrun (nodes as its flags number them), rank 0 once more
    # at start-up (nodes by hostname)
    planned = "threefold: warning: tp=2 spans nodes (ranks 0 on node 0, 1 on node 1;"
    assert log.count(planned) == 2, log[-3000:]
    assert log.count("threefold: warning: tp=2 spans nodes") == 3, log[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["comm_bytes_per_step"]["tp"] > 0
    assert s["topology"]["nodes"] == 2 and s["topology"]["ranks_per_node"] == [1, 1]
    assert sorted(s["topology"]["node_names"]) == ["node1", "node2"]
    assert s["topology"]["axes_across_nodes"] == ["tp"]
    losses = [r["loss"] for r in metrics(out)]
    assert losses == pytest.approx([r["loss"] for r in metrics(ref)], rel=1e-5)

def test_multi_node_flags_go_to_torchrun_only():
    from threefold.launch.launcher import split_train_args

    path, rest, nproc, launcher = split_train_args(
        ["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-conf",
         "join_timeout=900", "--train.steps", "3"])
    assert (path, rest, nproc) == (None, ["--train.steps", "3"], 2)
    assert launcher == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-conf",
                        "join_timeout=900"]


def test_a_bad_allocation_is_one_line_before_any_process(monkeypatch, capsys, tmp_path):
    from threefold.commands.main import main

    for k, v in dict(SLURM, SLURM_NNODES="").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    out = tmp_path / "never"
    assert main(["train", "--nproc-per-node", "2", "--train.output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["threefold: error: Slurm allocation: SLURM_NNODES='' is not a number; give "
                   "--nnodes N on the command line"]
    assert not out.exists()


def test_tp_across_the_nodes_asked_for_is_warned_before_launch(monkeypatch, capsys):
    """The launcher sees the trap from its flags (nodes × --nproc-per-node, ranks numbered
    node by node) before torchrun starts: tp 4 over nodes of 2 ranks is warned, in a dry
    run too; tp 2, one node, or a worker (WORLD_SIZE set) is not."""
    from threefold.commands.main import main
    from threefold.config import load_config
    from threefold.launch.launcher import node_span_warnings

    for k in ("WORLD_SIZE", "LOCAL_RANK", *SLURM):
        monkeypatch.delenv(k, raising=False)
    tp4 = load_config(None, [("parallel.tp", "4")])
    two_nodes = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500"]
    [line] = node_span_warnings(tp4, 4, 2)
    assert line.startswith("threefold: warning: tp=4 spans nodes (ranks 0 on node 0, 1 on node 0, "
                           "2 on node 1, 3 on node 1") and "parallel.tp dividing the 2" in line
    assert node_span_warnings(load_config(None, [("parallel.tp", "2")]), 4, 2) == []
    assert node_span_warnings(tp4, 4, 4) == []
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert node_span_warnings(tp4, 4, 2) == []
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["train", "--dry-run", "--nproc-per-node", "2", *two_nodes,
                 "--parallel.tp", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("threefold: warning: tp=4 spans nodes") == 1, err


def test_the_example_batch_script_launches_one_task_per_node(tmp_path):
    """examples/slurm/train.sbatch under a stand-in srun (records its command) and scontrol
    (the allocation's hosts): the rendezvous is the first host, every flag and option is one
    threefold knows, and the layout fits 2 nodes × 8."""
    from threefold.config import parse_overrides
    from threefold.launch.launcher import split_train_args, world_size_for
    from threefold.layout import validate_layout

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] '
                                   "&& printf 'gpu07\\ngpu08\\n'\n")
    (bin_ / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.txt\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_ID="555",
               SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[07-08]")
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "slurm", "train.sbatch")
    p = subprocess.run(["bash", script, "--train.steps", "3"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    argv = (tmp_path / "srun.txt").read_text().splitlines()
    srun_opts = argv[:argv.index("threefold")]
    assert "--ntasks-per-node=1" in srun_opts and argv[argv.index("threefold") + 1] == "train"
    path, rest, nproc, launcher = split_train_args(argv[argv.index("train") + 1:])
    assert path is None and nproc == 8
    assert launcher[:6] == ["--nnodes", "2", "--rdzv-endpoint", "gpu07:29500", "--rdzv-id",
                            "555"]
    cfg = load_config(None, parse_overrides(rest))
    assert cfg.train.steps == 3 and cfg.train.output_dir == "runs/slurm-555"
    validate_layout(cfg, world_size_for(nproc, launcher), cfg.model.resolved(vocab_size=256))
