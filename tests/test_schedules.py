"""Pipeline schedules as data: every schedule proven by the checker, broken lists caught, the
simulated bubble against the papers' formulas, activations in flight, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from threefold.schedules import (SCHEDULES, Action, ActionKind, Costs, DeadlockError, ScheduleError,
    build_schedule, check_actions, check_schedule, num_stages, peak_in_flight, simulate)
from threefold.schedules.actions import message_key
from threefold.parallel.pipeline.command import main
from threefold.schedules.simulate import measured_costs
from threefold.schedules.timeline import TraceRecord, ascii_timeline, chrome_trace

K = ActionKind
SENDS = (K.SEND_FORWARD, K.SEND_BACKWARD)
RECVS = (K.RECV_FORWARD, K.RECV_BACKWARD)


V_SHAPED = ("zb-v", "dualpipe-v")


def _chunks(name):
    """Model chunks per rank each schedule is tested with: two for the interleaved and the
    V-shaped ones."""
    return 2 if name == "interleaved-1f1b" or name in V_SHAPED else 1


def _cases():
    for name in SCHEDULES:
        for p in (2, 4):
            for m in (4, 8):
                yield name, p, m, _chunks(name)


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_every_schedule_passes_the_checker(name, p, m, v):
    result = check_schedule(name, p, m, v)
    lists = build_schedule(name, p, m, v)
    n = num_stages(name, p, v)
    kinds = Counter(a.kind for acts in lists for a in acts)
    assert kinds[K.FORWARD] == m * n  # one forward per (microbatch, stage) ...
    assert kinds[K.BACKWARD] + kinds[K.BACKWARD_INPUT] == m * n  # ... and one backward
    assert kinds[K.BACKWARD_WEIGHT] == kinds[K.BACKWARD_INPUT]
    # Every stage boundary carries one activation down and one gradient up per microbatch,
    # but the bottom of a V (stages p-1 and p, both on rank p-1), which is handed over here.
    sends = sorted(message_key(a) for acts in lists for a in acts if a.kind in SENDS)
    recvs = sorted(message_key(a) for acts in lists for a in acts if a.kind in RECVS)
    assert sends == recvs and len(sends) == 2 * m * (n - 1 - (name in V_SHAPED))
    assert all(a.peer is not None for acts in lists for a in acts if not a.kind.is_compute)
    assert result.makespan > 0


def test_all_small_sizes_pass_the_checker():
    """Wider net, including m < p (torchtitan #775's hang) and a single stage."""
    for name in SCHEDULES:
        for p in range(1, 6):
            for m in range(1, 11):
                for v in (1, 2, 3) if name == "interleaved-1f1b" else (_chunks(name),):
                    if name == "interleaved-1f1b" and m % p:
                        continue
                    check_schedule(name, p, m, v)


@pytest.mark.parametrize("args,match", [
    (("interleaved-1f1b", 4, 6, 2), r"multiple of pp.*microbatches=4 or 8"),
    (("interleaved-1f1b", 4, 2, 2), r"microbatches=4"),
    (("1f1b", 2, 4, 2), r"vpp=1"),
    (("gpipe", 2, 0, 1), r"microbatches must be an integer >= 1"),
    (("zb-h2", 2, 4, 1), r"choose one of"),
])
def test_impossible_settings_are_refused_with_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(*args)


# ---- deliberately broken lists -------------------------------------------------------------


def _lists(name="1f1b", p=2, m=4, v=1):
    return [list(acts) for acts in build_schedule(name, p, m, v)], m, num_stages(name, p, v)


def _index(acts, kind, mb):
    return next(i for i, a in enumerate(acts) if a.kind is kind and a.microbatch == mb)


def test_a_dropped_backward_is_caught():
    lists, m, n = _lists()
    del lists[1][_index(lists[1], K.BACKWARD, 2)]
    with pytest.raises(ScheduleError, match="microbatch 2 stage 1 .* 0 BW, 0 B and 0 W"):
        check_actions(lists, m, n)


def test_a_dropped_receive_is_caught():
    lists, m, n = _lists()
    del lists[1][_index(lists[1], K.RECV_FORWARD, 3)]  # the last one: FIFO pairing still fits
    with pytest.raises(ScheduleError, match="before F of microbatch 3 stage 0 has run on or"):
        check_actions(lists, m, n)


def test_waiting_for_a_gradient_before_sending_its_activation_deadlocks():
    # 1F1B p=2 rank 0 starts [F0, SEND_F0, F1, SEND_F1, RECV_B0, BW0]. Receive first: rank 0
    # then waits for microbatch 0's gradient, which needs the activation it has not sent.
    # Per-channel order is unchanged, so only the replay can see it.
    lists, m, n = _lists()
    f0, send_f0, f1, send_f1, recv_b0 = lists[0][:5]
    assert [a.kind for a in (f0, send_f0, f1, send_f1, recv_b0)] == [
        K.FORWARD, K.SEND_FORWARD, K.FORWARD, K.SEND_FORWARD, K.RECV_BACKWARD]
    lists[0][:5] = [f0, recv_b0, f1, send_f0, send_f1]
    with pytest.raises(DeadlockError) as err:
        check_actions(lists, m, n)
    blocked = "\n".join(err.value.blocked)
    assert "rank 0" in blocked and "RECV_B mb0" in blocked
    assert "rank 1" in blocked and "RECV_F mb0" in blocked


def test_order_inside_one_batch_does_not_matter():
    # Adjacent sends/receives are posted together (batch_isend_irecv): swapping them is safe.
    lists, m, n = _lists()
    r0 = lists[0]
    j = _index(r0, K.RECV_BACKWARD, 0)
    assert r0[j - 1].kind is K.SEND_FORWARD
    r0[j - 1], r0[j] = r0[j], r0[j - 1]
    check_actions(lists, m, n)


def test_receives_in_the_wrong_fifo_order_are_caught():
    lists, m, n = _lists("gpipe")
    r1 = lists[1]
    i, j = _index(r1, K.RECV_FORWARD, 0), _index(r1, K.RECV_FORWARD, 1)
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(ScheduleError, match="mismatched"):
        check_actions(lists, m, n)


def test_weight_grad_before_input_grad_is_caught():
    lists, m, n = _lists("zb-h1")
    r0 = lists[0]
    i, j = _index(r0, K.BACKWARD_INPUT, 1), _index(r0, K.BACKWARD_WEIGHT, 1)
    r0[i], r0[j] = r0[j], r0[i]
    with pytest.raises(ScheduleError, match="W .* before B"):
        check_actions(lists, m, n)


def test_a_message_to_the_wrong_rank_is_caught():
    lists, m, n = _lists("1f1b", p=4, m=4)
    i = _index(lists[1], K.SEND_FORWARD, 0)
    a = lists[1][i]
    lists[1][i] = Action(a.kind, a.microbatch, a.chunk, a.stage, peer=3)
    with pytest.raises(ScheduleError, match="stage 2 is on rank 2, not rank 3"):
        check_actions(lists, m, n)


# ---- bubble against the formulas -------------------------------------------------------------

EQUAL = Costs(1.0, 1.0, 1.0, 0.0)  # backward (B+W) twice the forward, as usual
UNIT_BACKWARD = Costs(1.0, 0.5, 0.5, 0.0)  # backward as long as forward


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16), (4, 2)])
@pytest.mark.parametrize("costs", [EQUAL, UNIT_BACKWARD])
def test_gpipe_and_1f1b_bubble(name, p, m, costs):
    # GPipe (arXiv 1811.06965): (p-1)/(m+p-1) of the step is idle; Narayanan et al. §2.2.1:
    # bubble time / ideal time = (p-1)/m. Exact with equal stages and free messages.
    r = simulate(name, p, m, 1, costs)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.bubble_over_ideal == pytest.approx((p - 1) / m, abs=1e-12)


def test_reference_check_p4_m8():
    r = simulate("1f1b", 4, 8)
    assert r.bubble_fraction == pytest.approx(3 / 11)  # 27.3%, GPipe's form
    assert r.bubble_over_ideal == pytest.approx(3 / 8)  # 37.5%, Narayanan's form


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_bubble(p, m, v):
    # Narayanan et al. §2.2.2 state the interleaved bubble relative to the ideal time (each
    # rank's own compute, m·v chunk forwards and backwards): (p-1)/(v·m). We test that form
    # because it is the paper's; as a fraction of the step it is (p-1)/(v·m + p - 1).
    # Per-action costs are per chunk (1/v of a rank's layers). Exact here (abs 1e-12) with
    # equal stages and free messages; Megatron's lockstep batches add no wait.
    r = simulate("interleaved-1f1b", p, m, v, EQUAL)
    assert r.bubble_over_ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    plain = simulate("1f1b", p, m, 1, Costs(v * 1.0, v * 1.0, v * 1.0))  # same model, v=1
    assert r.makespan < plain.makespan


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16), (4, 12)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    # Qi et al. (arXiv 2401.10241) with T_F = T_B = T_W: ZB-H1 idles (p-1)·(T_F+T_B-T_W)
    # per rank against 1F1B's (p-1)·(T_F+T_B+T_W): a third. We compare idle time per rank
    # (the fractions differ because the step lengths differ), within 1% (it comes out exact).
    zb, base = simulate("zb-h1", p, m, 1, EQUAL), simulate("1f1b", p, m, 1, EQUAL)
    idle = lambda r: r.makespan - sum(r.busy) / len(r.busy)  # noqa: E731
    assert idle(zb) / idle(base) == pytest.approx(1 / 3, rel=0.01)
    assert zb.bubble_over_ideal == pytest.approx((p - 1) / (3 * m), rel=0.01)


def test_message_time_lengthens_the_step_but_proves_nothing_new():
    fast = simulate("1f1b", 4, 8, 1, EQUAL)
    slow = simulate("1f1b", 4, 8, 1, Costs(1.0, 1.0, 1.0, 0.25))
    assert slow.makespan > fast.makespan and slow.bubble_fraction > fast.bubble_fraction
    assert sum(slow.busy) == sum(fast.busy)


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 4, 1), ("interleaved-1f1b", 4, 8, 2),
                                         ("zb-h1", 4, 8, 1)])
def test_action_names_parse_back(name, p, m, v):
    # trace records are named str(action); the simulator reads measured traces back by name
    for acts in build_schedule(name, p, m, v):
        for a in acts:
            assert Action.parse(str(a), p) == a
    for bad in ("optimizer step", "F mb1", "X mb0 s0", "F mbx s0", "F xx3 q1", "F mb3 s1->x2"):
        with pytest.raises(ValueError, match="not a pipeline action"):
            Action.parse(bad)


def test_unequal_stages_gpipe_makespan():
    # p=2, m=4, stage 1 twice as slow (a heavy head): stage 1 is the bottleneck, so the step is
    # stage 0's first forward, stage 1's m forwards and m backwards, stage 0's last backward:
    # 1 + 4·2 + 4·4 + 2 = 27; compute 12 + 24 of 2·27, a bubble of 1/3 (the formula says 1/5).
    costs = Costs(per_stage={("F", 0): 1.0, ("B", 0): 1.0, ("W", 0): 1.0,
                             ("F", 1): 2.0, ("BW", 1): 4.0})
    assert costs.of(ActionKind.BACKWARD, 0) == 2.0 and costs.of(ActionKind.BACKWARD, 1) == 4.0
    assert costs.of(ActionKind.FORWARD, 7) == 1.0  # stages not listed: the uniform times
    r = simulate("gpipe", 2, 4, 1, costs)
    assert r.makespan == pytest.approx(27.0)
    assert r.busy == pytest.approx([12.0, 24.0])
    assert r.bubble_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_measured_costs_round_trip(name, v):
    # A replay's own trace, read back as measured costs, replays to the same timeline: what
    # bench/bench_pipeline_idle.py does with a real run's trace.
    import random

    rng = random.Random(7)
    p, m = 4, 8
    n = p * v
    per = {(k, s): rng.uniform(0.5, 2.0) for k in ("F", "B", "W") for s in range(n)}
    if name != "zb-h1":
        per.update({("BW", s): per[("B", s)] + per[("W", s)] for s in range(n)})
    truth = simulate(name, p, m, v, Costs(t_comm=0.1, per_stage=per))
    got = measured_costs([truth.records()])
    assert got.t_comm == pytest.approx(0.1)
    used = {k for k in per if name == "zb-h1" or k[0] in ("F", "BW")}
    assert set(got.per_stage) == used
    for k in used:
        assert got.per_stage[k] == pytest.approx(per[k])
    again = simulate(name, p, m, v, got)
    assert again.makespan == pytest.approx(truth.makespan)
    assert again.bubble_fraction == pytest.approx(truth.bubble_fraction)


# ---- activations in flight -------------------------------------------------------------------


def test_peak_in_flight():
    p, m = 4, 8
    assert peak_in_flight("gpipe", p, m) == m
    assert [peak_in_flight("1f1b", p, m, 1, r) for r in range(p)] == [4, 3, 2, 1]
    assert [peak_in_flight("1f1b", p, 2, 1, r) for r in range(p)] == [2, 2, 2, 1]
    assert all(peak_in_flight("zb-h1", p, m, 1, r) == p for r in range(p))  # 1F1B's peak
    # Korthikanti et al. (arXiv 2205.05198): interleaving holds 1 + (p-1)/(p·v) times more.
    for v in (2, 4):
        factor = 1 + (p - 1) / (p * v)
        assert peak_in_flight("interleaved-1f1b", p, m, v) == pytest.approx(p * factor)


# ---- CLI, trace, picture ---------------------------------------------------------------------


def test_cli_json(capsys):
    assert main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["bubble_over_ideal"] == pytest.approx(3 / 8)
    assert (out["pp"], out["microbatches"], out["vpp"]) == (4, 8, 1)
    assert out["peak_in_flight_microbatches"] == [4, 3, 2, 1]
    assert out["messages_per_step"] == 2 * 8 * 3


def test_cli_costs_from_a_trace(tmp_path, capsys):
    # a trace (here the simulator's own, in ms) read back as measured costs gives the same
    # step; a trace of another split, or no trace at all, is refused in one line
    trace = tmp_path / "t.json"
    base = ["--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--json"]
    assert main(base + ["--t-f", "3", "--t-b", "2", "--t-w", "1", "--t-comm", "0.5",
                        "--trace", str(trace)]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(base + ["--costs-from", str(trace)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["makespan_ms"] == pytest.approx(want["makespan_ms"])
    assert got["bubble_fraction"] == pytest.approx(want["bubble_fraction"])
    assert got["costs_ms"]["t_comm"] == pytest.approx(0.5)
    assert main(["--pp", "4", "--microbatches", "4", "--schedule", "1f1b",
                 "--costs-from", str(trace)]) == 2
    assert "2 pipeline stages" in capsys.readouterr().err
    # a run with dp 2 traces two pipelines: the trace names them, the first one is used
    data = json.loads(trace.read_text())
    copy = [dict(e, pid=e["pid"] + 2) for e in data["traceEvents"] if e["ph"] == "X"]
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"traceEvents": data["traceEvents"] + copy}))
    assert main(base + ["--costs-from", str(two)]) == 2  # which messages pair up is unclear
    assert "more than one pipeline" in capsys.readouterr().err
    two.write_text(json.dumps({"traceEvents": data["traceEvents"] + copy,
                               "otherData": {"pipelines": [[0, 1], [2, 3]]}}))
    assert main(base + ["--costs-from", str(two)]) == 0
    assert json.loads(capsys.readouterr().out)["makespan_ms"] == pytest.approx(
        want["makespan_ms"])
    trace.write_text("{}")
    assert main(base + ["--costs-from", str(trace)]) == 2
    assert "not a readable Chrome trace" in capsys.readouterr().err


def test_cli_text_shows_a_timeline(capsys):
    assert main(["--pp", "2", "--microbatches", "4", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "rank  0 |" in out and "rank  1 |" in out and "no deadlock" in out


@pytest.mark.parametrize("argv,match", [
    (["--pp", "4", "--microbatches", "8", "--schedule", "zb"], "invalid choice"),
    (["--pp", "4", "--microbatches", "6", "--schedule", "interleaved-1f1b", "--vpp", "2"],
     "multiple of pp"),
    (["--pp", "4", "--microbatches", "8"], "required"),
    (["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--t-f", "-1"], ">= 0"),
    (["--pp", "2", "--microbatches", "2", "--schedule", "1f1b", "--trace", "/no/such/dir/t.json",
      "--json"], "cannot write"),
])
def test_cli_bad_args_one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and match in captured.err


@pytest.mark.parametrize("name,v,per_mb_stage", [("1f1b", 1, 2), ("zb-h1", 1, 3),
                                                  ("interleaved-1f1b", 2, 2)])
def test_cli_trace_is_chrome_json_with_one_event_per_compute(tmp_path, capsys, name, v,
                                                             per_mb_stage):
    path = tmp_path / "trace.json"
    argv = ["--pp", "2", "--microbatches", "4", "--schedule", name, "--vpp", str(v),
            "--trace", str(path), "--json"]
    assert main(argv) == 0
    events = json.loads(path.read_text())["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert len(compute) == per_mb_stage * 4 * 2 * v
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys() for e in compute)
    assert {e["pid"] for e in compute} == {0, 1}
    assert sum(e["dur"] for e in compute if e["pid"] == 0) > 0


def test_chrome_trace_from_measured_records():
    recs = [TraceRecord(0, "F mb0 s0", 0.0, 0.002, "compute"),
            TraceRecord(0, "SEND_F mb0 s0->r1", 0.002, 0.0025, "comm"),
            TraceRecord(1, "F mb0 s1", 0.0025, 0.0045, "compute")]
    events = [e for e in chrome_trace(recs)["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in events] == pytest.approx([0, 2000, 2500])  # microseconds
    assert [e["dur"] for e in events] == pytest.approx([2000, 500, 2000])
    assert events[0]["tid"] != events[1]["tid"]  # compute and comm on separate rows
    assert ascii_timeline(recs, width=10).count("\n") == 1  # two ranks, two rows


PNG_ARGS = ["--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--png"]


@pytest.mark.parametrize("extra", [[], ["--schedule", "zb-v", "--vpp", "2"],
                                   ["--schedule", "dualpipe-v", "--vpp", "2"],
                                   ["--schedule", "interleaved-1f1b", "--vpp", "2",
                                    "--inflight", "3"]],
                         ids=["1f1b", "zb-v", "dualpipe-v", "interleaved-bounded"])
def test_cli_png(tmp_path, capsys, extra):
    """``threefold schedule --png --json`` draws every schedule and prints its figures."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    assert main(PNG_ARGS + [str(path), "--json"] + extra) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    info = json.loads(capsys.readouterr().out)
    assert info["schedule"] == (extra[1] if extra else "1f1b")
    assert len(info["peak_in_flight_microbatches"]) == 2


def test_cli_png_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(PNG_ARGS + [str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_the_pure_half_imports_no_torch():
    code = ("import sys, threefold.parallel.pipeline as p, threefold.schedules.check, "
            "threefold.schedules.timeline; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------
# V-shaped schedules (ZB-V, DualPipeV)
# --------------------------------------------------------------------------------------------
def test_v_placement_puts_both_ends_on_rank_0():
    from threefold.schedules.actions import rank_stage, stage_rank

    for p in (1, 2, 3, 8):
        stages = [[rank_stage(r, c, p, vshape=True) for c in (0, 1)] for r in range(p)]
        assert stages == [[r, 2 * p - 1 - r] for r in range(p)]
        assert all(stage_rank(s, p, vshape=True) == r for r in range(p) for s in stages[r])
        assert [stage_rank(s, p) for s in range(2 * p)] == list(range(p)) * 2  # Megatron's


@pytest.mark.parametrize("name,m_from", [("zb-v", lambda p: 2 * p - 2),
                                         ("dualpipe-v", lambda p: 2 * p)])
def test_v_schedules_bubble_and_memory_equal_their_closed_forms(name, m_from):
    """With T_F = T_B = T_W the only idle time left is the start-up's p - 1 chunk forwards
    (ZB-V's published bubble is "≈ 0"; DualPipeV's (PP/2 - 1)(F&B + B - 3W) with PP = 2p
    stages and no overlap, F&B = F + B + W): (p - 1)/(6m) of the ideal, half ZB-H1's. In
    flight: 2p chunk activations on every rank for ZB-V (p microbatches of the rank's layers,
    1F1B's), 2p + 1 for DualPipeV (its published PP + 1)."""
    from threefold.schedules.registry import in_flight_chunks, schedule_spec

    spec = schedule_spec(name)
    checked = 0
    for p in range(2, 9):
        for m in range(max(1, m_from(p)), 4 * p + 1, 2):
            sim = simulate(name, p, m, 2, EQUAL)
            assert sim.bubble_over_ideal == pytest.approx((p - 1) / (6 * m)), (p, m)
            assert spec.bubble(p, m, 2) == pytest.approx(sim.bubble_over_ideal)
            assert spec.bubble(p, m, 2) == pytest.approx(schedule_spec("zb-h1").bubble(p, m, 1) / 2)
            peak = [in_flight_chunks(acts) for acts in build_schedule(name, p, m, 2)]
            want = [min(2 * p + (name == "dualpipe-v"), m + r + 1) for r in range(p)]
            assert peak == want, (p, m)
            checked += 1
    assert checked > 30


def test_v_schedules_refuse_other_chunk_counts():
    from threefold.layout import Layout, Workload, check_layout
    from threefold.config import ModelConfig

    for name in V_SHAPED:
        with pytest.raises(ValueError, match=f"{name} runs two model chunks per rank in a V: "
                                             "set vpp=2"):
            build_schedule(name, 4, 8, 1)
        with pytest.raises(ValueError, match=f"parallel.schedule: {name} runs two model chunks "
                                             "per rank in a V: set parallel.vpp 2"):
            check_layout(ModelConfig(preset="llama3-8b").resolved(),
                         Layout(pp=4, vpp=3, schedule=name),
                         Workload(seq_len=4096, global_batch=32))


# --------------------------------------------------------------------------------------------
# Interleaved 1F1B with a bound on the activations in flight
# --------------------------------------------------------------------------------------------
GRID = [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16), (8, 2, 16), (8, 4, 16), (16, 7, 32)]


@pytest.mark.parametrize("p,v,m", GRID)
def test_bounded_interleaved_holds_its_bound_and_trades_bubble(p, v, m):
    """Every bound from the smallest that runs to Megatron's peak passes the checker; each
    rank's peak is min(bound, Megatron's 2(p-r-1) + (v-1)p + 1); at a round trip's v·p the
    bubble is 2(p-1)/(3vm), below Megatron's (p-1)/(vm); the planner's estimate is within a
    third of the replay from halfway down; a smaller bound never has a smaller bubble."""
    from threefold.schedules.bounded import bubble_estimate, min_inflight
    from threefold.schedules.registry import in_flight_chunks

    megatron = 2 * (p - 1) + (v - 1) * p + 1
    last = None
    low = min_inflight(p, v)
    caps = sorted({megatron + 2, megatron, v * p, v * p - 1, (v * p + low) // 2, low + 1, low},
                  reverse=True)
    for cap in caps:
        lists = build_schedule("interleaved-1f1b", p, m, v, inflight=cap)
        check_actions(lists, m, p * v)
        peak = [in_flight_chunks(acts) for acts in lists]
        assert peak == [min(cap, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]
        bubble = simulate("interleaved-1f1b", p, m, v, EQUAL, inflight=cap).bubble_over_ideal
        if cap >= v * p:
            assert bubble == pytest.approx(2 * (p - 1) / (3 * v * m))
            assert bubble_estimate(p, m, v, cap) == pytest.approx(bubble)
        elif 2 * cap >= v * p + min_inflight(p, v):
            assert bubble_estimate(p, m, v, cap) == pytest.approx(bubble, rel=0.35)
        assert last is None or bubble >= last - 1e-9
        last = bubble
    assert simulate("interleaved-1f1b", p, m, v, EQUAL).bubble_over_ideal == \
        pytest.approx((p - 1) / (v * m))  # the default: Megatron's warm-up, unchanged


def test_bounded_interleaved_refuses_what_cannot_run():
    with pytest.raises(ValueError, match=r"pipeline_inflight=4 .* at least \(vpp-1\)·pp \+ 1 = 5"):
        build_schedule("interleaved-1f1b", 4, 8, 2, inflight=4)
    with pytest.raises(ValueError, match="pipeline_inflight applies to interleaved-1f1b"):
        build_schedule("1f1b", 4, 8, 1, inflight=6)
    with pytest.raises(ValueError, match="integer >= 0"):
        build_schedule("interleaved-1f1b", 4, 8, 2, inflight=-1)


def test_zb_h1_closed_form_is_exact_from_m_equal_p():
    """The planner's search takes split schedules' closed forms where they are exact (equal
    F, B and W): ZB-H1's (p-1)/(3m) from m = p on (the V schedules' from m = 2p: above)."""
    from threefold.schedules.registry import schedule_spec

    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            replay = simulate("zb-h1", p, m, 1, EQUAL).bubble_over_ideal
            assert replay == pytest.approx(schedule_spec("zb-h1").bubble(p, m, 1)), (p, m)
