"""Shared fixtures: a small corpus and the overrides that make a run take seconds on 2 cores."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest

# Print every thread's stack if a test hangs (hangs must be diagnosable, not silent).
faulthandler.enable(file=sys.stderr)

# Every distributed run of the suite, in this process and in the ones it starts (test
# launcher, torchrun), compares its ranks' collectives at start-up's end and each step's end
# (threefold.comm.collective_check): a process-dependent order fails the test that meets it.
os.environ.setdefault("THREEFOLD_CHECK_COLLECTIVES", "1")


def write_corpus(path: Path, kb: int = 160) -> Path:
    """A deterministic text corpus: the first ``kb`` KB of a few standard-library modules."""
    from threefold.data.corpus import sample_corpus

    return sample_corpus(path, kb)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Path of the shared small corpus."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A tokenizer/token cache shared by the session's runs."""
    return tmp_path_factory.mktemp("cache")


def tiny_overrides(corpus: Path, cache: Path, out: Path, **extra) -> list[tuple[str, str]]:
    """Overrides for a seconds-long run of a 2-layer, 64-wide model."""
    base = {
        "data.corpus": str(corpus), "data.cache_dir": str(cache), "data.vocab_size": "320",
        "data.seq_len": "32", "model.hidden_size": "64", "model.intermediate_size": "128",
        "model.num_hidden_layers": "2", "model.num_attention_heads": "4",
        "model.num_key_value_heads": "2", "train.global_batch_size": "8",
        "train.micro_batch_size": "8", "train.steps": "6", "train.output_dir": str(out),
        "train.eval_batches": "2", "train.eval_interval": "0", "train.log_interval": "100",
        "train.progress": "off", "optim.warmup_steps": "2", "optim.lr": "3e-3",
        # Adam's ε: with 1e-8, an element whose gradient is at rounding-noise level steps by
        # ±lr according to its sign, so two equivalent computations that sum in different
        # orders (layouts, TRL) could differ by 2·lr there; 1e-6 keeps such steps small and
        # leaves every gradient above it compared as before
        "optim.eps": "1e-6",
    }
    base.update({k.replace("__", "."): str(v) for k, v in extra.items()})
    return list(base.items())


def metrics(out: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    import json

    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out: Path) -> dict:
    """The model tensors of a run's newest checkpoint."""
    from threefold.weights.checkpoint_verify import list_checkpoints
    from threefold.weights.checkpoint import load_checkpoint

    step = list_checkpoints(out / "checkpoints")[-1]
    return load_checkpoint(out / "checkpoints" / str(step))[0]["model"]


def hf_twin(hf, folder: Path, prompt_len: int = 24):
    """``hf`` (a transformers causal LM) saved to ``folder`` and read back as threefold's:
    (its ModelConfig, its weights, threefold's model holding them, token ids of 2 rows of
    ``prompt_len``, transformers' logits of them), the logits of both checked equal (fp32,
    1e-5)."""
    import torch

    from threefold.weights.hf import load_pretrained
    from threefold.model.decoder import CausalLM

    hf.save_pretrained(folder)
    cfg, weights = load_pretrained(folder)
    model = CausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, prompt_len))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model.eval()(ids), want, rtol=0, atol=1e-5)
    return cfg, weights, model, ids, want


def assert_layouts_train_as_one_process(out: Path, over, layouts, world: int = 2) -> dict:
    """For runs already made under ``out`` (``single`` and one per layout name, ``over``
    giving each one's overrides): every layout's losses equal the single process's (rel
    1e-5) and its final weights (1e-4 / 2e-5), and its bytes per axis equal the planner's
    and the dry run's (ep's within 10%: the planner takes routing as even). Returns the
    single process's final weights."""
    import json

    import torch

    from threefold.accounting import comm_bytes_per_step
    from threefold.config import load_config
    from threefold.launch.dryrun import predict
    from threefold.layout import Layout, Workload

    ref, ref_w = metrics(out / "single"), final_weights(out / "single")
    for name, extra in layouts:
        got = metrics(out / name)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), \
            name
        w = final_weights(out / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
        cfg = load_config(None, over(out / f"{name}-plan", **extra))
        want = comm_bytes_per_step(cfg.model.resolved(cfg.data.vocab_size),
                                   Layout.from_config(cfg, world), Workload.from_config(cfg), 0)
        moved = {a: v for a, v in json.loads((out / name / "summary.json").read_text())
                 ["comm_bytes_per_step"].items() if v}
        assert moved.pop("ep", 0) == pytest.approx(want["ep"], rel=0.1), name
        assert moved == {a: v for a, v in want.items() if v and a != "ep"}, name
        assert predict(cfg, world).comm_bytes == want, name
    return ref_w
