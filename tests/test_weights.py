"""Sources of logical tensors read by region (``threefold.weights``): every box of every tensor
equals the same slice of the whole tensor, bit for bit, whatever holds it (a dict, a Hugging
Face folder in any of its layouts, a checkpoint cut into pieces as any layout cuts it), and
reading a box takes exactly the box's bytes from the files. ``threefold convert`` streams: a
sharded export that transformers loads, and a multi-file import that loads and resumes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from threefold.weights import hf
from threefold.weights import hf_config
from threefold import weights
from threefold.weights.checkpoint_verify import CheckpointError, Piece, list_checkpoints
from threefold.weights.checkpoint import load_checkpoint, save_checkpoint, save_streamed
from threefold.config import ModelConfig
from threefold.weights import CheckpointSource, DictSource, HFSource

GEN = torch.Generator().manual_seed(0)


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def _boxes(shape, n=12):
    """Random boxes of ``shape``: full-rank and shorter ones, empty ones, the whole tensor."""
    out = [(), tuple((0, s) for s in shape)]
    for i in range(n):
        rank = len(shape) if i % 3 else int(torch.randint(0, len(shape) + 1, (1,), generator=GEN))
        box = []
        for s in shape[:rank]:
            a, b = sorted(torch.randint(0, s + 1, (2,), generator=GEN).tolist())
            box.append((a, b if i % 5 else min(a + 1, s)))
        out.append(tuple(box))
    return out


def _region(t, box):
    return t[tuple(slice(a, b) for a, b in box)]


def check_reads(source, whole: dict, n=12) -> None:
    """Every box read equals the same region of the whole tensor (stored dtype and fp32), and
    ``bytes_read`` grows by exactly the box's elements × the stored element size."""
    for (kind, name), t in whole.items():
        assert source.shape(name, kind) == tuple(t.shape), (kind, name)
        for box in _boxes(tuple(t.shape), n):
            before = source.bytes_read
            got = source.read(name, box, kind, dtype=None)
            want = _region(t, box)
            assert got.dtype == t.dtype and got.is_contiguous()
            assert torch.equal(got, want), (kind, name, box)
            assert source.bytes_read - before == want.numel() * t.element_size(), (name, box)
            assert torch.equal(source.read(name, box, kind), want.float())


@pytest.fixture(params=[64 << 20, 48], ids=["blocks-64MiB", "blocks-48B"])
def block(request, monkeypatch):
    """Reads in the default blocks, and in blocks so small that every path of the block
    split runs (several rows, one row, part of a row)."""
    monkeypatch.setattr(weights.base, "BLOCK_BYTES", request.param)  # where blocks() reads it
    return request.param


def test_dict_source_reads_regions(block):
    t = {"a": _rand(5, 7), "b": _rand(3, 4, 6), "c": _rand(9)}
    check_reads(DictSource(t), {("model", k): v for k, v in t.items()})
    src = DictSource({"model": t, "optim": {"a.exp_avg": t["a"] * 2}})
    assert src.names("exp_avg") == ["a"] and src.shape("nope") is None
    with pytest.raises(IndexError):
        src.read("a", ((0, 6),))


# --------------------------------------------------------------------------------------------
# Hugging Face folders
# --------------------------------------------------------------------------------------------
LLAMA = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2).resolved()
MIXTRAL = dataclasses.replace(LLAMA, num_local_experts=4, num_experts_per_tok=2)


def _weights(cfg, dtype=torch.float32):
    return {n: _rand(*s, dtype=dtype) for n, s in hf_config.expected_shapes(cfg).items()}


def _hf_folder(path: Path, cfg, tensors: dict, files: int = 1) -> Path:
    """A Hugging Face folder holding ``tensors`` in ``files`` files (an index if more)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config.hf_config(cfg)))
    names = list(tensors)
    if files == 1:
        save_file(tensors, str(path / hf_config.SINGLE), metadata={"format": "pt"})
        return path
    wmap = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::files]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(part, file))
    (path / hf_config.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return path


def _per_expert(cfg, fused: dict) -> dict:
    """The published Mixtral layout of fused expert tensors."""
    out, f = {}, cfg.intermediate_size
    for name, t in fused.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest == "mlp.gate.weight":
            out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = t
        elif rest.startswith("mlp.experts."):
            for e in range(cfg.num_local_experts):
                w1, w3, w2 = hf_config.hub_names(int(layer), e)
                if rest.endswith("down_proj"):
                    out[w2] = t[e].clone()
                else:
                    out[w1], out[w3] = t[e, :f].clone(), t[e, f:].clone()
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("case", ["llama", "tied", "bf16", "sharded", "mixtral", "mixtral-fused",
                                  "mixtral-sharded"])
def test_hf_source_reads_regions(tmp_path, case, block):
    cfg = dataclasses.replace(MIXTRAL if case.startswith("mixtral") else LLAMA,
                              tie_word_embeddings=case == "tied")
    w = _weights(cfg, torch.bfloat16 if case == "bf16" else torch.float32)
    stored = dict(w)
    if case in ("mixtral", "mixtral-sharded"):
        stored = _per_expert(cfg, w)
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # ignored
    if case == "tied":  # some tied folders store the head too: ignored, as the embedding
        stored["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    src = HFSource(_hf_folder(tmp_path / "hf", cfg, stored, 3 if "sharded" in case else 1))
    assert src.config == cfg and sorted(src.names()) == sorted(w)
    check_reads(src, {("model", k): v for k, v in w.items()}, n=4)
    if case == "tied":  # the head is the embedding: the folder's copy is not served
        assert "lm_head.weight" not in src.names() and src.shape("lm_head.weight") is None
    if case.startswith("mixtral"):  # experts 1..2 only: their w1 and w3 rows, nothing else
        name = "model.layers.1.mlp.experts.gate_up_proj"
        before = src.bytes_read
        got = src.read(name, ((1, 3), (5, 30)))
        assert torch.equal(got, w[name][1:3, 5:30])
        assert src.bytes_read - before == 2 * 25 * 16 * 4
    assert src.shape("model.norm.weight", "exp_avg") is None


def test_hf_source_checks_headers_only(tmp_path):
    """A wrong shape is named from the header alone; a tensor that is not floating point
    too; a missing expert is named."""
    w = _weights(LLAMA)
    bad = {**w, "model.layers.1.mlp.up_proj.weight": torch.zeros(5, 16)}
    with pytest.raises(hf_config.HFError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\."
                                         r"up_proj\.weight has shape \(5, 16\)"):
        HFSource(_hf_folder(tmp_path / "a", LLAMA, bad))
    with pytest.raises(hf_config.HFError, match="torch.int64, not floating point"):
        HFSource(_hf_folder(tmp_path / "b", LLAMA, {**w, "x": torch.zeros(2, dtype=torch.int64)}))
    per = _per_expert(MIXTRAL, _weights(MIXTRAL))
    per.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight")
    with pytest.raises(hf_config.HFError, match=r"experts\.3\.w2\.weight is missing"):
        HFSource(_hf_folder(tmp_path / "c", MIXTRAL, per))


# --------------------------------------------------------------------------------------------
# threefold checkpoints cut as layouts cut them
# --------------------------------------------------------------------------------------------
def _cut(name, kind, t, tp_dim=None, tp_count=1, ranges=1, gen=GEN) -> list[Piece]:
    """The pieces of ``t``: tensor-parallel slices along ``tp_dim`` (ceil(n / count) long, the
    last padded with zeros, as a padded vocabulary is), each cut into ``ranges`` flat ranges
    at random points (ZeRO shards cut rows anywhere)."""
    slices = [t]
    if tp_dim is not None:
        step = math.ceil(t.shape[tp_dim] / tp_count)
        pad = [0] * (2 * t.dim())
        pad[2 * (t.dim() - 1 - tp_dim) + 1] = step * tp_count - t.shape[tp_dim]
        padded = torch.nn.functional.pad(t.float(), pad).to(t.dtype)
        slices = list(padded.split(step, tp_dim))
    out = []
    for i, s in enumerate(slices):
        flat = s.contiguous().reshape(-1)
        cuts = sorted(torch.randint(0, flat.numel() + 1, (ranges - 1,), generator=gen).tolist())
        for a, b in zip([0, *cuts], [*cuts, flat.numel()]):
            out.append(Piece(name, kind, flat[a:b].clone(), a, b, tuple(t.shape), tp_dim, i,
                             tp_count))
    return out


def _checkpoint(root: Path, ranks: list[list[Piece]], state=None) -> Path:
    return save_streamed(root, 1, ranks, {"cpu_rng": torch.arange(3)}, state or {"step": 1}, 1)


LAYOUTS = {  # name -> [(shape, tp_dim, tp_count, ranges), ...]
    "whole": [((37, 16), None, 1, 1), ((16,), None, 1, 1), ((4, 48, 16), None, 1, 1)],
    "tp-vocab-dim0": [((37, 16), 0, 4, 1), ((30, 16), 0, 3, 1), ((4, 48, 16), 0, 2, 1)],
    "tp-dim1": [((16, 37), 1, 4, 1), ((4, 16, 24), 1, 2, 1), ((4, 48, 16), 2, 3, 1)],
    "zero-flat": [((37, 16), None, 1, 5), ((16,), None, 1, 3), ((4, 48, 16), None, 1, 7)],
    "tp-and-zero": [((37, 16), 0, 4, 3), ((16, 37), 1, 2, 4), ((4, 48, 16), 1, 2, 3)],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_source_reads_regions(tmp_path, layout, block):
    whole, ranks = {}, [[], [], []]
    for i, (shape, dim, count, ranges) in enumerate(LAYOUTS[layout]):
        for kind in ("model", "exp_avg", "exp_avg_sq"):
            dtype = torch.bfloat16 if (i, kind) == (1, "model") else torch.float32
            t = whole[kind, f"w{i}"] = _rand(*shape, dtype=dtype)
            for j, p in enumerate(_cut(f"w{i}", kind, t, dim, count, ranges)):
                ranks[(i + j) % 3].append(p)  # spread over rank files as ranks hold them
    path = _checkpoint(tmp_path / "ck", ranks)
    src = CheckpointSource(path)
    assert sorted(src.names()) == sorted(src.names("exp_avg_sq")) == ["w0", "w1", "w2"]
    check_reads(src, whole, n=8)
    # the whole-tensor loaders read the same
    tensors, state = load_checkpoint(path)
    assert state == {"step": 1} and torch.equal(tensors["rng"]["cpu_rng"], torch.arange(3))
    assert all(torch.equal(tensors["model"][n], whole["model", n]) for n in tensors["model"])
    assert torch.equal(tensors["optim"]["w2.exp_avg"], whole["exp_avg", "w2"])


def test_replicated_pieces_are_read_once(tmp_path):
    t = _rand(10, 6)
    pieces = _cut("w", "model", t, ranges=3)
    path = _checkpoint(tmp_path / "ck", [pieces, _cut("w", "model", t, ranges=2)])
    check_reads(CheckpointSource(path), {("model", "w"): t})


def test_open_sharded_reads_regions_of_a_received_part(tmp_path):
    """Two nodes without a shared filesystem: each reads a region of a tensor half of which
    only the other node holds (that part arrives over the control channel)."""
    from tests.test_checkpoint_nodes import W, _in_threads, _save_two

    roots = [tmp_path / "n0", tmp_path / "n1"]
    _save_two(roots, 2)

    def one(rank, group):
        src, state, rng = weights.open_sharded(roots[rank], 2, rank, group)
        return src.read("w", ((1, 3), (1, 3))), state, rng

    for rank, (got, state, rng) in enumerate(_in_threads(one)):
        assert torch.equal(got, W.view(3, 4)[1:3, 1:3]) and state == {"step": 2}
        assert torch.equal(rng["cpu_rng"], torch.ones(2) * rank)


def test_bytes_read_are_the_boxes_bytes(tmp_path):
    """An eighth of a weight's rows, or of its columns, from a one-rank checkpoint reads an
    eighth of its bytes; rows of a ZeRO-cut tensor read just those rows."""
    t = _rand(256, 64)
    path = _checkpoint(tmp_path / "ck", [_cut("w", "model", t) + _cut("z", "model", t, ranges=9)])
    src = CheckpointSource(path)
    opened = src.bytes_read
    assert torch.equal(src.read("w", ((32, 64),)), t[32:64])
    assert src.bytes_read - opened == t.numel() * 4 // 8
    assert torch.equal(src.read("w", ((0, 256), (8, 16))), t[:, 8:16])
    assert src.bytes_read - opened == 2 * t.numel() * 4 // 8
    assert torch.equal(src.read("z", ((100, 101),)), t[100:101])
    assert src.bytes_read - opened == 2 * t.numel() * 4 // 8 + 64 * 4


def test_crc_checked_when_a_read_covers_a_piece_and_incomplete_named(tmp_path, block):
    t = _rand(8, 4)
    flat = t.reshape(-1)
    path = _checkpoint(tmp_path / "ck", [[Piece("w", "model", flat[:13], 0, 13, (8, 4)),
                                          Piece("w", "model", flat[13:], 13, 32, (8, 4))]])
    f = path / "rank0.safetensors"
    with safe_open(str(f), "pt") as sf:
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    first = next(k for k in tensors if k.endswith("/0"))
    tensors[first][0] += 1  # damage the first piece; its file digest is bypassed below
    save_file(tensors, str(f))
    meta = json.loads((path / "rank0.json").read_text())
    files = {n: path / n for n in ("state.json", "rank0.json", "rank0.safetensors")}
    src = CheckpointSource(path, files)  # as if verified: only the CRC can tell
    src.read("w", ((0, 3),))  # the damaged piece is not read whole: not checked
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors: tensor model w does not "
                                              "match its CRC-32"):
        src.read("w")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        CheckpointSource(path)  # the file's SHA-256, checked on opening, catches it first
    meta["pieces"] = meta["pieces"][:1]
    (path / "rank0.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"tensor model w is incomplete \(slice 0 of 1\)"):
        CheckpointSource(path, files)


# --------------------------------------------------------------------------------------------
# threefold convert, streamed
# --------------------------------------------------------------------------------------------
def _run_checkpoint(root: Path, cfg: ModelConfig, w: dict) -> Path:
    return save_checkpoint(root / "checkpoints", 3, {"model": w, "optim": {}, "rng": {}},
                           {"step": 3, "model_config": dataclasses.asdict(cfg)}, keep_last=1)


@pytest.mark.parametrize("cfg", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_sharded_export_and_multi_file_import_round_trip(tmp_path, cfg):
    transformers = pytest.importorskip("transformers")
    from threefold.model.decoder import CausalLM

    w = _weights(cfg)
    _run_checkpoint(tmp_path / "run", cfg, w)
    hf.export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=6000)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    index = json.loads((tmp_path / "hf" / hf_config.INDEX).read_text())
    assert len(shards) > 3 and not (tmp_path / "hf" / hf_config.SINGLE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    sizes = [sum(math.prod(safe_open(str(tmp_path / "hf" / s), "pt").get_slice(k).get_shape())
                 * 4 for k in safe_open(str(tmp_path / "hf" / s), "pt").keys()) for s in shards]
    assert index["metadata"]["total_size"] == sum(sizes)
    assert all(s <= 6000 or len(safe_open(str(tmp_path / "hf" / n), "pt").keys()) == 1
               for s, n in zip(sizes, shards))
    # transformers loads the shards: the same logits as threefold's model
    ours = CausalLM(cfg).eval()
    ours.load_state_dict(w, strict=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=GEN)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5
    # import into several rank files; it loads (and resumes, below) as any checkpoint
    ckpt = hf.convert_from_hf(tmp_path / "hf", tmp_path / "imported", seed=5, max_file_bytes=9000)
    ranks = sorted(p.name for p in ckpt.glob("rank*.safetensors"))
    assert len(ranks) > 2
    tensors, state = load_checkpoint(ckpt)
    assert set(tensors["model"]) == set(w)
    assert all(torch.equal(tensors["model"][n], w[n]) for n in w)
    assert {"step", "optim_step", "sampler", "config", "model_config", "scheduler"} <= set(state)
    src = CheckpointSource(ckpt)
    for r in range(len(ranks)):  # every rank finds the seeded RNG state
        assert torch.equal(src.rank_tensors(r)["cpu_rng"],
                           torch.Generator().manual_seed(5).get_state())
    # and back again: the same folder content; either folder opens for init_from
    hf.export_hf(tmp_path / "imported", tmp_path / "back")
    for path, kind in ((tmp_path / "back", HFSource), (tmp_path / "imported", CheckpointSource)):
        got, back = weights.open_pretrained(path)
        assert got == cfg and isinstance(back, kind)
        assert all(torch.equal(back.read(n), w[n]) for n in w)


def test_imported_multi_file_checkpoint_resumes_training(corpus, cache_dir, tmp_path):
    from conftest import tiny_overrides
    from threefold.config import load_config
    from threefold.training.train import train

    first = train(load_config(None, tiny_overrides(corpus, cache_dir, tmp_path / "run",
                                                   train__steps=2)))
    hf.export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=40_000)
    assert (tmp_path / "hf" / hf_config.INDEX).is_file()
    imp = tmp_path / "imported"
    ckpt = hf.convert_from_hf(tmp_path / "hf", imp, max_file_bytes=40_000)
    assert len(list(ckpt.glob("rank*.json"))) > 2 and list_checkpoints(imp / "checkpoints") == [0]
    again = train(load_config(None, tiny_overrides(corpus, cache_dir, imp, train__steps=3,
                                                   checkpoint__resume="true")))
    assert again["resumed_from_step"] == 0
    assert again["initial_validation_loss"] == pytest.approx(first["validation_loss"], abs=1e-6)


def test_materializing_refuses_a_missing_or_misshapen_weight_by_name():
    """A parameter the source lacks, or holds at another shape, is an error naming it (never
    left at zeros), in the whole-tensor path and the ZeRO shard path alike; a missing moment
    is simply absent (a fresh or converted checkpoint has none); any other KeyError of a
    source passes through."""
    from torch import nn

    from threefold.parallel.materialize import fill_flat, materialize_parameters

    def meta_linear():
        with torch.device("meta"):
            return nn.Linear(4, 3, bias=False)

    good = DictSource({"weight": torch.ones(3, 4)})
    m = meta_linear()
    materialize_parameters(m, good, torch.device("cpu"))
    assert torch.equal(m.weight, torch.ones(3, 4))
    with pytest.raises(weights.MissingTensor, match="tensor weight"):
        materialize_parameters(meta_linear(), DictSource({"other": torch.ones(3, 4)}),
                               torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \(4, 3\).*needs \(3, 4\)"):
        materialize_parameters(meta_linear(), DictSource({"weight": torch.ones(4, 3)}),
                               torch.device("cpu"))
    out = torch.zeros(6)
    with pytest.raises(weights.MissingTensor, match="tensor weight"):
        fill_flat(DictSource({}), [("weight", m.weight)], [0], out, 0)
    assert not fill_flat(good, [("weight", m.weight)], [0], out, 0, kind="exp_avg")

    class Broken(DictSource):
        def read(self, *args, **kwargs):
            raise KeyError("unrelated")  # a bug in a source, not a tensor it lacks

    with pytest.raises(KeyError, match="unrelated"):  # passes through, even for a moment
        fill_flat(Broken({}), [("weight", m.weight)], [0], out, 0, kind="exp_avg")
    assert fill_flat(good, [("weight", m.weight)], [0], out, 3) and torch.equal(out, torch.ones(6))


def test_planner_counts_the_readers_block_size():
    """The planner's formulas import no torch, so they keep their own copy of the largest
    block a file read takes at once; it must be the reader's."""
    from threefold.plan.startup import READ_BLOCK_BYTES
    assert READ_BLOCK_BYTES == weights.base.BLOCK_BYTES
