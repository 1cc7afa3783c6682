"""Training reads prepared shards and mixtures: the allocation of sequences to
sources, epochs without replacement, document masking, held-out validation per source,
refusals, metrics, resume and data-parallel equivalence."""

from __future__ import annotations

import json
import random
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch

from threefold.config import ConfigError, DataConfig, load_config
from threefold.data import DataError, prepare_data
from threefold.data import prepare as prep
from threefold.data import HeldOutSampler, MixtureSampler
from threefold.data.sampler import Permutation, allocation, integer_weights
from threefold.data import TokenSource
from threefold.data.sources import TokenStream, _Shard, parse_mix
from threefold.data import train_bpe
from threefold.launch.launcher import load_run_config

from conftest import metrics, tiny_overrides
from dist import run_distributed

L, G = 8, 6


def ramp_source(name: str, n: int, base: int = 0, weight=1, doc_len: int = 0,
                shard_tokens: int = 0) -> TokenSource:
    """A source whose token at stream position p is base + p (so a window shows where it was
    cut from), in shards of ``shard_tokens``, with documents of ``doc_len`` tokens."""
    ids = np.arange(base, base + n, dtype=np.uint32)
    size = shard_tokens or n
    shards = []
    for lo in range(0, n, size):
        part = ids[lo:lo + size]
        ends = np.arange(doc_len, len(part) + 1, doc_len, dtype=np.uint64) if doc_len else \
            np.array([len(part)], dtype=np.uint64)
        if int(ends[-1]) != len(part):
            ends = np.append(ends, np.uint64(len(part)))
        shards.append(_Shard(None, len(part), len(ends), ids.dtype, tokens=part, ends=ends))
    n_train = n - max(round(n * 0.1), L + 1)
    return TokenSource(name, name, TokenStream(shards), n_train, f"digest-{name}", "tok",
                       Fraction(weight))


# -- allocation --------------------------------------------------------------------------------

def _deviation(order: np.ndarray, counts: list[int], s: int) -> np.ndarray:
    """count_s(n) − n·w_s for n = 0..2 periods."""
    twice = np.concatenate([order, order])
    had = np.concatenate([[0], np.cumsum(twice == s)])
    return had - np.arange(len(had)) * counts[s] / sum(counts)


def test_allocation_keeps_every_prefix_within_one_sequence():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.choice([2, 3, 4, 6])
        counts = [rng.randint(1, 60) for _ in range(k)]
        order = allocation(counts)
        assert np.bincount(order, minlength=k).tolist() == counts  # exact per period
        for s in range(k):
            dev = _deviation(order, counts, s)
            # Tijdeman's bound: within 1 − 1/(2k−2) of the share after any n sequences
            assert np.abs(dev).max() <= 1 - 1 / (2 * k - 2) + 1e-9
            if k == 2:  # two sources: every window, wherever it starts, within one
                assert dev.max() - dev.min() <= 1 + 1e-9


def test_integer_weights_exact_or_rounded():
    assert integer_weights([Fraction("0.7"), Fraction("0.3")]) == [7, 3]
    assert integer_weights([Fraction(2), Fraction(2), Fraction(4)]) == [1, 1, 2]
    odd = integer_weights([Fraction("0.123456789"), Fraction(1)])
    assert sum(odd) == 1 << 16 and abs(odd[0] / sum(odd) - 0.123456789 / 1.123456789) < 2e-5
    with pytest.raises(DataError, match="1/65536"):
        integer_weights([Fraction(1, 10**7), Fraction(1)])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_and_keyed(n):
    p = Permutation(n, 0, "web", 0)
    image = [p(j) for j in range(n)]
    assert sorted(image) == list(range(n))
    if n >= 64:
        assert image != list(range(n))
        assert image != [Permutation(n, 0, "web", 1)(j) for j in range(n)]  # a new epoch
        assert image != [Permutation(n, 1, "web", 0)(j) for j in range(n)]  # another seed


# -- the training sampler ----------------------------------------------------------------------

def test_one_source_epochs_without_replacement():
    src = ramp_source("a", 400)
    s = MixtureSampler([src], L, G, seed=3)
    n = s.samples[0]
    assert n == (src.n_train - 1) // L
    starts = []
    steps = -(-3 * n // G)  # three epochs
    for step in range(steps):
        b = s.global_batch(step)
        x, y = b["input_ids"], b["labels"]
        assert torch.equal(x, x[:, :1] + torch.arange(L)) and torch.equal(y, x + 1)
        starts += x[:, 0].tolist()
    assert all(st % L == 0 and st + L + 1 <= src.n_train for st in starts)
    epochs = [starts[e * n:(e + 1) * n] for e in range(3)]
    for e in epochs:  # every sample exactly once per epoch
        assert sorted(e) == [j * L for j in range(n)]
    assert epochs[0] != epochs[1] != epochs[2]
    prog = s.progress(steps - 1)
    assert prog["tokens_seen"]["a"] == steps * G * L
    assert prog["epoch"]["a"] == pytest.approx(steps * G / n)


def test_batches_are_a_function_of_seed_and_step_and_split_by_rank():
    srcs = [ramp_source("a", 500), ramp_source("b", 300, base=10_000, weight=3)]
    a, b = MixtureSampler(srcs, L, G, seed=7), MixtureSampler(srcs, L, G, seed=7)
    b.global_batch(50)  # touching other steps first changes nothing
    for step in (0, 1, 9):
        want = a.global_batch(step)
        assert torch.equal(want["input_ids"], b.global_batch(step)["input_ids"])
        for dp in (2, 3):
            parts = [a.local_batch(step, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat([p["input_ids"] for p in parts]), want["input_ids"])
    other = MixtureSampler(srcs, L, G, seed=8).global_batch(0)["input_ids"]
    assert not torch.equal(other, a.global_batch(0)["input_ids"])
    with pytest.raises(DataError, match="multiple"):
        a.local_batch(0, 0, 4)


def test_mixture_proportions_hold_over_windows_of_steps():
    srcs = [ramp_source("web", 2000, weight="0.7"), ramp_source("code", 900, base=50_000,
                                                                weight="0.3")]
    s = MixtureSampler(srcs, L, G, seed=1)
    per_step = []
    for step in range(40):
        x = s.global_batch(step)["input_ids"]
        per_step.append(int((x[:, 0] >= 50_000).sum()))  # rows from "code"
    for lo in range(40):
        for hi in range(lo + 1, 41):
            rows = G * (hi - lo)
            assert abs(sum(per_step[lo:hi]) - 0.3 * rows) <= 1 + 1e-9
    assert s.progress(39)["tokens_seen"] == {"web": 168 * L, "code": 72 * L}


def test_windows_cross_shards_and_document_masking():
    src = ramp_source("a", 300, doc_len=5, shard_tokens=35)  # shards end at documents
    s = MixtureSampler([src], L, 64, seed=0, document_mask=True)
    b = s.global_batch(0)
    x, y, docs, pos = b["input_ids"], b["labels"], b["document_ids"], b["position_ids"]
    assert torch.equal(x, x[:, :1] + torch.arange(L))  # contiguous across shard boundaries
    want_docs = x // 5 - x[:, :1] // 5
    assert torch.equal(docs, want_docs)
    assert torch.equal(pos[x % 5 == 0], torch.zeros_like(pos[x % 5 == 0]))
    assert torch.equal(pos[:, 1:][x[:, 1:] % 5 != 0], (pos[:, :-1] + 1)[x[:, 1:] % 5 != 0])
    crossing = (x + 1) % 5 == 0  # a document's last token: its label is the next document's
    assert bool((y[crossing] == -100).all()) and torch.equal(y[~crossing], (x + 1)[~crossing])


def test_held_out_windows_are_fixed_per_source():
    srcs = [ramp_source("a", 600), ramp_source("b", 400, base=10_000)]
    for src in srcs:
        v = HeldOutSampler(src, L, 4, 3)
        x = torch.cat([v.local_batch(k, 0, 1)["input_ids"] for k in range(3)])
        base = int(src.stream.read(0, 1)[0])
        assert int(x[0, 0]) == base + src.n_train  # first held-out window
        assert int(x[-1, -1]) == base + len(src.stream) - 2  # last, whose label ends the stream
        halves = [v.local_batch(1, r, 2)["input_ids"] for r in range(2)]
        assert torch.equal(torch.cat(halves), v.local_batch(1, 0, 1)["input_ids"])


def test_state_dict_resumes_and_refuses_other_data():
    srcs = [ramp_source("a", 500), ramp_source("b", 300, base=10_000, weight=2)]
    run = MixtureSampler(srcs, L, G, seed=5)
    for step in range(3):
        run.local_batch(step, 1, 2)
    state = json.loads(json.dumps(run.state_dict()))
    resumed = MixtureSampler(srcs, L, G, seed=0)
    resumed.load_state_dict(state)
    assert resumed.step == 3 and resumed.seed == 5
    assert torch.equal(resumed.local_batch(3, 1, 2)["input_ids"],
                       run.local_batch(3, 1, 2)["input_ids"])
    with pytest.raises(DataError, match="global_batch_size"):
        MixtureSampler(srcs, L, G * 2).load_state_dict(state)
    with pytest.raises(DataError, match="sources"):
        MixtureSampler(srcs[:1] + [ramp_source("b", 301, base=10_000, weight=2)], L,
                       G).load_state_dict(state)
    with pytest.raises(DataError, match="weights"):
        MixtureSampler([srcs[0], ramp_source("b", 300, base=10_000)], L,
                       G).load_state_dict(state)
    with pytest.raises(DataError, match="start a new run"):
        run.load_state_dict({"seed": 1, "step": 2, "num_tokens": 10})


def test_parse_mix_names_the_field():
    assert parse_mix("web=/d/w:0.7, code=/d/c:3") == [("web", "/d/w", Fraction("0.7")),
                                                      ("code", "/d/c", Fraction(3))]
    assert parse_mix("a=C:/x:1")[0][1] == "C:/x"  # a colon inside the path is kept
    for bad, needle in (("web=/d/w", "NAME=DIR:WEIGHT"), ("=/d:1", "NAME=DIR:WEIGHT"),
                        ("a=/d:x", "not a number"), ("a=/d:0", "positive"),
                        ("a=/d:1,a=/e:1", "twice"), (",", "twice")):
        with pytest.raises(DataError, match=needle) as e:
            parse_mix(bad)
        assert str(e.value).startswith("data.mix")


# -- prepared directories in training ----------------------------------------------------------

def _docs(n: int, seed: int, words=("alpha", "beta", "gamma", "delta", "shard", "rank")):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 90))) for _ in range(n)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two sources prepared with one tokenizer (small shards, so windows cross them) and a
    third prepared with another."""
    root = tmp_path_factory.mktemp("prepared")
    tok = root / "tok.json"
    tok.write_text(train_bpe(_docs(200, 0), 320).to_str())
    out = {}
    for name, seed, words in (("web", 1, None), ("code", 2, ("def", "return", "self", "x"))):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n"
                               for d in _docs(300, seed, *([words] if words else []))))
        out[name] = root / name
        prep.prepare(prep.Options(sources=[str(src)], out=str(out[name]), tokenizer=str(tok),
                                  shard_tokens=4000, quiet=True))
    other = root / "other.json"
    other.write_text(train_bpe(_docs(200, 5), 300).to_str())
    out["other"] = root / "other"
    prep.prepare(prep.Options(sources=[str(root / "web.jsonl")], out=str(out["other"]),
                              tokenizer=str(other), quiet=True))
    return out


def _mix(p, a=0.7, b=0.3) -> str:
    return f"web={p['web']}:{a},code={p['code']}:{b}"


def test_prepare_data_reads_prepared_shards(prepared, tmp_path):
    cfg = DataConfig(mix=_mix(prepared), seq_len=32, cache_dir=str(tmp_path))
    data = prepare_data(cfg)
    assert [s.name for s in data.sources] == ["web", "code"]
    assert [s.weight for s in data.sources] == [Fraction("0.7"), Fraction("0.3")]
    index = json.loads((prepared["web"] / "index.json").read_text())
    web = data.sources[0]
    assert len(web.stream.shards) == len(index["shards"]) > 1
    whole = np.concatenate([np.fromfile(prepared["web"] / f"{s['name']}.bin", dtype=np.uint16)
                            for s in index["shards"]])
    assert np.array_equal(web.stream.read(0, len(whole)), whole)
    assert data.vocab_size == index["settings"]["vocab_size"]
    one = prepare_data(DataConfig(corpus=str(prepared["code"]), seq_len=32))
    assert [s.name for s in one.sources] == ["code"]


def test_prepared_refusals_before_launch(prepared, tmp_path):
    def load(**over):
        return load_run_config(None, [(f"data.{k}", str(v)) for k, v in over.items()])

    with pytest.raises(ConfigError, match="'web'.*'code'.*different tokenizers"):
        load(mix=f"web={prepared['other']}:1,code={prepared['code']}:1")
    with pytest.raises(ConfigError, match="data.mix and data.corpus"):
        load(mix=_mix(prepared), corpus=str(prepared["web"]))
    with pytest.raises(ConfigError, match="data.mix 'nope'.*not a prepared directory"):
        load(mix=f"web={prepared['web']}:1,nope={tmp_path}:1")
    with pytest.raises(ConfigError, match="data.tokenizer"):
        load(corpus=str(prepared["web"]), tokenizer=str(prepared["other"] / "tokenizer.json"))
    half = tmp_path / "half"
    shutil.copytree(prepared["code"], half)
    index = json.loads((half / "index.json").read_text())
    index["complete"] = False
    (half / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="not finished"):
        load(corpus=str(half))
    index["complete"] = True
    (half / "index.json").write_text(json.dumps(index))
    (half / f"{index['shards'][-1]['name']}.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="not the size"):
        prepare_data(DataConfig(corpus=str(half), seq_len=32))


def _mix_run(prepared, out, **extra):
    over = {"data.corpus": "stdlib", "data.mix": _mix(prepared), "data.seq_len": 32,
            "data.document_mask": "true", "train.steps": 4}
    over.update({k.replace("__", "."): v for k, v in extra.items()})
    base = dict(tiny_overrides("stdlib", out.parent / "cache", out))
    base.update({k: str(v) for k, v in over.items()})
    return load_config(None, list(base.items()))


def test_mixture_run_records_sources_and_resumes_bit_identically(prepared, tmp_path):
    from threefold.training.train import train

    full = tmp_path / "full"
    s = train(_mix_run(prepared, full, train__eval_interval=2))
    recs = metrics(full)
    sampler = MixtureSampler(prepare_data(_mix_run(prepared, full).data).sources, 32, 8)
    for r in recs:
        assert r["tokens_seen"] == sampler.progress(r["step"] - 1)["tokens_seen"]
        assert set(r["epoch"]) == {"web", "code"} and r["epoch"]["web"] > 0
    assert r["tokens_seen"]["web"] + r["tokens_seen"]["code"] == 4 * 8 * 32
    by = recs[-1]["validation_loss_by_source"]
    assert recs[-1]["validation_loss"] == pytest.approx(0.7 * by["web"] + 0.3 * by["code"])
    assert s["validation_loss"] == recs[-1]["validation_loss"]
    part = tmp_path / "part"
    train(_mix_run(prepared, part, checkpoint__interval=2, checkpoint__save_final="false"))
    shutil.rmtree(part / "checkpoints" / "4")
    train(_mix_run(prepared, part, checkpoint__resume="true"))
    assert [r["loss"] for r in metrics(part)] == [r["loss"] for r in recs]


def _dp_losses(rank, world, cfg):
    from threefold.parallel.distributed_world import Distributed
    from threefold.training.train import train

    return [train(cfg, Distributed(cfg))["final_loss"]]


def test_data_parallel_reads_disjoint_rows_and_trains_as_one_process(prepared, tmp_path):
    from threefold.training.train import train

    one = train(_mix_run(prepared, tmp_path / "one"))
    cfg = _mix_run(prepared, tmp_path / "dp", parallel__dp_shard=2)
    two = run_distributed(_dp_losses, 2, cfg)[0]
    assert two[0] == pytest.approx(one["final_loss"], rel=1e-5)
    assert [r["loss"] for r in metrics(tmp_path / "dp")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "one")], rel=1e-5)
