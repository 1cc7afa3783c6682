"""`threefold data prepare`: every input format, directories, bad records, parallel workers,
a failed write and the resume after it, and both ways of getting a tokenizer."""

from __future__ import annotations

import errno
import gzip
import json
import random

import numpy as np
import pytest

from threefold.data import prepare as prep
from threefold.data import DataError
from threefold.data import eot_id, load_tokenizer, train_bpe

WORDS = "alpha beta gamma delta épsilon zeta eta théta iota kappa λ mu 数据 nu".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) + "\n"
            for _ in range(n)]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe(_docs(300, seed=9), 400).to_str())
    return path


def _expected(tok_file, docs: list[str]) -> np.ndarray:
    tok = load_tokenizer(tok_file)
    tok.encode_special_tokens = True
    eot = eot_id(tok)
    return np.array([i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eot]])


def _stream(out) -> tuple[np.ndarray, np.ndarray]:
    """All tokens of a prepared directory and every document's length."""
    index = prep.verify(out)
    dtype = index["settings"]["dtype"]
    ids = [np.fromfile(out / f"{s['name']}.bin", dtype=dtype) for s in index["shards"]]
    lengths = [np.diff(np.fromfile(out / f"{s['name']}.ends", dtype="<u8"), prepend=0)
               for s in index["shards"]]
    return np.concatenate(ids), np.concatenate(lengths).astype(np.int64)


def _run(sources, out, tok=None, **kw) -> dict:
    kw.setdefault("quiet", True)
    return prep.prepare(prep.Options(sources=[str(s) for s in sources], out=str(out),
                                     tokenizer=str(tok) if tok else None, **kw))


def _write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d, "id": 1}) + "\n")


def _write(fmt: str, where, docs):
    """``docs`` in format ``fmt`` under directory ``where``; returns the source to name."""
    if fmt == "txt":
        for i, d in enumerate(docs):
            (where / f"doc{i:03d}.txt").write_text(d)
        return where
    if fmt == "jsonl":
        _write_jsonl(where / "a.jsonl", docs)
    elif fmt == "jsonl.gz":
        _write_jsonl(where / "a.jsonl.gz", docs, gzip.open)
    elif fmt == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        (where / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    elif fmt in ("parquet", "arrow", "arrow-stream"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": list(range(len(docs))), "text": docs})
        if fmt == "parquet":
            pq.write_table(table, where / "a.parquet", row_group_size=7)
        else:
            new = pa.ipc.new_file if fmt == "arrow" else pa.ipc.new_stream
            with new(str(where / "a.arrow"), table.schema) as w:
                for batch in table.to_batches(max_chunksize=9):
                    w.write_batch(batch)
    elif fmt == "dataset":
        import datasets

        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(where / "ds"))
        return where / "ds"
    return where


FORMATS = ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-stream",
           "dataset"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_each_documents_tokens_then_eot(tmp_path, tok_file, fmt):
    docs = _docs(40)
    (tmp_path / "in").mkdir()
    source = _write(fmt, tmp_path / "in", docs)
    index = _run([source], tmp_path / "out", tok_file, shard_tokens=300)
    ids, lengths = _stream(tmp_path / "out")
    want = _expected(tok_file, docs)
    assert np.array_equal(ids, want)
    assert len(lengths) == len(docs) == index["documents"]
    assert ids[np.cumsum(lengths) - 1].tolist() == [index["settings"]["eot_id"]] * len(docs)
    assert index["complete"] and index["bad_records"] == 0 and len(index["shards"]) > 1
    assert index["tokens"] == len(want) and index["settings"]["dtype"] == "uint16"
    assert all(s["tokens"] <= 300 for s in index["shards"])


def test_a_directory_of_mixed_inputs_is_read_in_sorted_order(tmp_path, tok_file):
    a, b, c = _docs(10, 1), _docs(10, 2), _docs(10, 3)
    (tmp_path / "in" / "x").mkdir(parents=True)
    (tmp_path / "in" / "y").mkdir()
    _write("parquet", tmp_path / "in" / "x", a)
    _write("dataset", tmp_path / "in" / "y", b)
    _write("jsonl.gz", tmp_path / "in", c)
    (tmp_path / "in" / "notes.bin").write_bytes(b"\0\1")  # not a supported input: left out
    index = _run([tmp_path / "in"], tmp_path / "out", tok_file)
    names = [s["path"] for s in index["sources"]]
    assert names == sorted(names) and len(names) == 3
    by_name = {"a.jsonl.gz": c, "a.parquet": a, "ds": b}
    docs = [d for n in names for d in by_name[n.rsplit("/", 1)[1]]]
    assert np.array_equal(_stream(tmp_path / "out")[0], _expected(tok_file, docs))


def test_one_and_two_workers_write_the_same_bytes(tmp_path, tok_file):
    (tmp_path / "in").mkdir()
    for i in range(3):
        _write_jsonl(tmp_path / "in" / f"{i}.jsonl", _docs(200, i))
    for w in (1, 2):
        _run([tmp_path / "in"], tmp_path / f"out{w}", tok_file, workers=w, shard_tokens=2000,
             batch_mb=0.002)
    files = sorted(p.name for p in (tmp_path / "out1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "out2").iterdir())
    for name in files:
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()


def test_bad_records_are_counted_and_named_by_file_and_line(tmp_path, tok_file):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": "cut off\n\n[1, 2]\n'
                     b'"a plain string"\n{"text": "bad \xff byte"}\n{"text": 3}\n')
    (tmp_path / "t.txt").write_bytes(b"line one\nline \xfe two\n")
    index = _run([path, tmp_path / "t.txt"], tmp_path / "out", tok_file)
    assert index["bad_records"] == 5 and index["documents"] == 3
    examples = index["files"][str(path)]["bad_examples"]
    assert [e.split(": ")[0] for e in examples] == [f"{path}:{n}" for n in (2, 4, 6, 7)]
    assert "malformed JSON" in examples[0] and "undecodable" in examples[2]
    txt = index["files"][str(tmp_path / "t.txt")]["bad_examples"]
    assert txt[0].startswith(f"{tmp_path / 't.txt'}:2: undecodable")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset"])
def test_a_missing_text_field_names_the_file_and_the_field(tmp_path, tok_file, fmt):
    (tmp_path / "in").mkdir()
    source = _write(fmt, tmp_path / "in", _docs(5))
    with pytest.raises(DataError, match=r"no text field 'body'") as e:
        _run([source], tmp_path / "out", tok_file, text_key="body")
    assert str(tmp_path / "in") in str(e.value)


def test_a_failed_write_leaves_valid_shards_and_the_rerun_matches(tmp_path, tok_file,
                                                                  monkeypatch):
    (tmp_path / "in").mkdir()
    for i in range(3):
        _write_jsonl(tmp_path / "in" / f"{i}.jsonl", _docs(150, i))
    opts = dict(shard_tokens=1500, batch_mb=0.001)
    whole = _run([tmp_path / "in"], tmp_path / "whole", tok_file, **opts)
    real, calls = prep._write_bytes, []

    def full_disk(fh, data):
        calls.append(1)
        if len(calls) == 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fh, data)

    monkeypatch.setattr(prep, "_write_bytes", full_disk)
    with pytest.raises(DataError, match="No space left on device.*rerun the same command"):
        _run([tmp_path / "in"], tmp_path / "out", tok_file, **opts)
    index = prep.verify(tmp_path / "out")  # every listed shard is complete and verifies
    assert not index["complete"] and 0 < len(index["shards"]) < len(whole["shards"])
    assert len(index["files"]) >= 1 and not list((tmp_path / "out").glob(".*tmp"))
    monkeypatch.setattr(prep, "_write_bytes", real)
    resumed = _run([tmp_path / "in"], tmp_path / "out", tok_file, **opts)
    assert resumed["shards"] == whole["shards"]
    for s in whole["shards"]:
        for ext in (".bin", ".ends"):
            assert (tmp_path / "out" / (s["name"] + ext)).read_bytes() == \
                (tmp_path / "whole" / (s["name"] + ext)).read_bytes()


def test_a_resume_with_other_settings_or_changed_input_is_refused(tmp_path, tok_file):
    _write_jsonl(tmp_path / "a.jsonl", _docs(20))
    _run([tmp_path / "a.jsonl"], tmp_path / "out", tok_file)
    with pytest.raises(DataError, match="other settings"):
        _run([tmp_path / "a.jsonl"], tmp_path / "out", tok_file, shard_tokens=7)
    _write_jsonl(tmp_path / "a.jsonl", _docs(21))
    with pytest.raises(DataError, match="changed since"):
        _run([tmp_path / "a.jsonl"], tmp_path / "out", tok_file)


def test_a_given_tokenizer_is_copied_and_a_bpe_is_trained_on_a_sample(tmp_path, tok_file):
    _write_jsonl(tmp_path / "a.jsonl", _docs(200))
    given = _run([tmp_path / "a.jsonl"], tmp_path / "given", tok_file)
    assert (tmp_path / "given" / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    trained = _run([tmp_path / "a.jsonl"], tmp_path / "bpe", vocab_size=300, sample_mb=0.002)
    assert trained["settings"]["tokenizer_sha256"] != given["settings"]["tokenizer_sha256"]
    assert trained["settings"]["vocab_size"] <= 300
    tok = tmp_path / "bpe" / "tokenizer.json"
    docs = [json.loads(line)["text"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert np.array_equal(_stream(tmp_path / "bpe")[0], _expected(tok, docs))
    # The trained BPE saw only the sample: a bigger sample learns different merges.
    more = _run([tmp_path / "a.jsonl"], tmp_path / "bpe2", vocab_size=300, sample_mb=1)
    assert more["settings"]["tokenizer_sha256"] != trained["settings"]["tokenizer_sha256"]


def test_the_command_line(tmp_path, tok_file, capsys):
    _write_jsonl(tmp_path / "a.jsonl", _docs(20))
    out = tmp_path / "out"
    argv = ["prepare", str(tmp_path / "a.jsonl"), "--out", str(out), "--tokenizer",
            str(tok_file), "--workers", "1"]
    assert prep.main(argv) == 0
    assert "20 documents" in capsys.readouterr().err
    assert prep.main(argv + ["--quiet"]) == 0  # already complete: nothing to do
    assert prep.main(["prepare", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
