"""Reward model: the Bradley–Terry loss and transformers' last-token rule, training on the
built-in pairs with TRL's metric names, DP2 / ZeRO-3×2 / TP2 (and TP2 + SP) equal to one
process, the export as a transformers LlamaForSequenceClassification scoring as we do, and
`threefold reward` out of the box after `threefold train`, with bad input refused before
anything is written."""

from __future__ import annotations

import functools
import json
import math
import shutil

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from tests.test_sft import base, data  # noqa: F401
from threefold.config import load_config
from threefold.post.reward import (RewardOptions, RewardTask, add_score_head,
                                   bradley_terry_loss, last_token_index)
from threefold.training.train import train

KEYS = ("loss", "accuracy", "margin", "mean_reward", "grad_norm")


def test_bradley_terry_loss_and_last_non_padding_token():
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g,
                                                                           dtype=torch.float64)
    want = -torch.log(1 / (1 + torch.exp(-(c - r))))
    torch.testing.assert_close(bradley_terry_loss(c, r), want)
    torch.testing.assert_close(bradley_terry_loss(c, r, 0.01), want + 0.01 * (c + r) ** 2)
    assert bradley_terry_loss(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(math.log(2))
    x = torch.zeros(1, requires_grad=True)
    bradley_terry_loss(x, torch.zeros(1)).sum().backward()
    assert x.grad.item() == pytest.approx(-0.5)  # raising the chosen score lowers the loss
    pad = 1
    ids = torch.tensor([[5, 6, 7, 1, 1], [5, 1, 1, 1, 1], [5, 6, 7, 8, 9], [1, 1, 1, 1, 1],
                        [1, 6, 1, 8, 1]])
    # the rightmost token that is not padding (transformers' rule; a row of padding -> 0)
    assert last_token_index(ids, pad).tolist() == [2, 0, 4, 0, 3]


def write_pairs(root):
    """12 of the built-in pairs for training and 4 for validation."""
    from threefold.post import example_path

    pairs = example_path("reward.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(pairs[:12]) + "\n")
    (root / "val.jsonl").write_text("\n".join(pairs[-4:]) + "\n")


def reward_task(root):
    """The pairs of ``write_pairs``, with TRL's centring term on."""
    return RewardTask(RewardOptions(data=str(root / "train.jsonl"),
                                    val_data=str(root / "val.jsonl"),
                                    center_rewards_coefficient=0.01))


def reward_overrides(corpus, cache, out, **extra):
    """A 6-step reward run of the tiny model (from ``checkpoint__init_from`` when given)."""
    extra = {"data__seq_len": 64, "train__steps": 6, "train__eval_batches": 1,
             "optim__lr": 1e-3, "optim__weight_decay": 0.0, **extra}
    return tiny_overrides(corpus, cache, out, **extra)


RUNS = [("dp2", {}), ("zero3_accum", {"parallel__zero_stage": 3, "train__micro_batch_size": 2}),
        ("tp2", {"parallel__tp": 2}),
        ("tp2_sp", {"parallel__tp": 2, "parallel__sequence_parallel": "true"}),
        ("cp2_ulysses", {"parallel__cp": 2, "parallel__cp_algorithm": "ulysses"})]


def our_scores(weights: dict, mcfg, ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Scores of ``ids`` by a fresh reward model holding ``weights`` (one process)."""
    from threefold.training.train import build_model

    model = add_score_head(build_model(mcfg, torch.device("cpu"), 0), 0)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        h = model(ids)
        return model.score(h[torch.arange(ids.shape[0]), last_token_index(ids, pad)])[:, 0]


@pytest.mark.slow
def test_reward_learns_layouts_equal_single_process_and_export_scores_equal(
        corpus, cache_dir, base, tmp_path):
    transformers = pytest.importorskip("transformers")
    from threefold.weights.hf import export_hf
    from threefold.training.train import build_run

    write_pairs(tmp_path)
    # from a pre-trained LM, as `threefold reward` starts. (From random weights some gradient
    # elements are within float noise of 0 at step 1, where AdamW's first update
    # lr·g/(|g|+eps) turns that noise into weight differences of ~lr/10.)
    overrides = functools.partial(reward_overrides, corpus, cache_dir,
                                  checkpoint__init_from=str(base / "run"))
    summary = train(load_config(None, overrides(tmp_path / "single")),
                    task=reward_task(tmp_path))
    ref = metrics(tmp_path / "single")
    assert all(set(KEYS) <= set(r) for r in ref) and len(ref) == 6
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in ref)
    assert ref[-1]["loss"] < ref[0]["loss"] and ref[-1]["margin"] > ref[0]["margin"]
    assert summary["validation_loss"] == summary["validation_loss"]  # a number
    run_distributed(train_runs, 2, overrides, tmp_path, RUNS,
                    functools.partial(reward_task, tmp_path), timeout=300)
    ref_w = final_weights(tmp_path / "single")
    assert "score.weight" in ref_w and "lm_head.weight" not in ref_w
    for name, _ in RUNS:
        got = metrics(tmp_path / name)
        for k in KEYS:
            tol = {"abs": 1e-5} if k in ("margin", "mean_reward") else {"rel": 1e-5}
            assert [r[k] for r in got] == pytest.approx([r[k] for r in ref], **tol), (name, k)
        w = final_weights(tmp_path / name)
        assert set(w) == set(ref_w), name
        for k, v in ref_w.items():
            assert ((w[k] - v).norm() / v.norm()).item() <= 1e-5, (name, k)
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")

    # export: transformers' sequence classifier scores right-padded rows as we do
    export_hf(tmp_path / "single", tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForSequenceClassification"]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    run = build_run(load_config(None, overrides(tmp_path / "x")), task=reward_task(tmp_path))
    pad = run.task.pad
    assert hf.config.pad_token_id == pad
    batch = run.sampler.local_batch(0, 0, 1)
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    assert (ids == pad).any()  # padded rows of several lengths
    ours = our_scores(ref_w, run.model_cfg, ids, pad)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[:, 0]
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert ours.std().item() > 0  # a trained head tells the rows apart


def test_reward_cli_out_of_the_box_after_train_and_bad_input(corpus, cache_dir, base,
                                                           tmp_path, monkeypatch, capsys):
    """`threefold train` then `threefold reward` with no data or init option: runs/default ->
    runs/reward on the built-in pairs. A malformed pairs file and pp > 1 fail in one line,
    exit 2, before anything is written."""
    from threefold.commands.main import main as cli_main

    monkeypatch.chdir(tmp_path)
    shutil.copytree(base / "run", "runs/default")  # what `threefold train` leaves
    common = ["--data.corpus", str(corpus), "--data.cache_dir", str(cache_dir),
              "--train.progress", "off", "--data.seq_len", "64"]
    assert cli_main(["reward", *common, "--train.steps", "2"]) == 0
    recs = metrics(tmp_path / "runs/reward")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(set(KEYS) <= set(r) for r in recs)
    assert (tmp_path / "runs/reward/checkpoints/2").is_dir()
    w = final_weights(tmp_path / "runs/reward")
    assert tuple(w["score.weight"].shape) == (1, 64) and "lm_head.weight" not in w
    # resume: 2 more steps from the checkpoint equal an uninterrupted 4-step run
    assert cli_main(["reward", *common, "--train.steps", "4", "--checkpoint.resume", "true"]) == 0
    assert cli_main(["reward", *common, "--train.steps", "4",
                     "--train.output_dir", "runs/reward4"]) == 0
    resumed, whole = metrics(tmp_path / "runs/reward"), metrics(tmp_path / "runs/reward4")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for k in KEYS:
        assert [r[k] for r in resumed] == [r[k] for r in whole], k

    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "Q", "chosen": "A", "rejected": "B"})
    for text, why in [(good + "\n{not json\n", "bad.jsonl:2: not valid JSON"),
                      (good + "\n" + json.dumps({"prompt": "Q", "chosen": "A"}) + "\n",
                       "bad.jsonl:2: record has no 'rejected'"),
                      (json.dumps({"prompt": "Q", "chosen": "A", "rejected": [{}]}) + "\n",
                       "bad.jsonl:1: prompt, chosen and rejected must all be strings")]:
        bad.write_text(text)
        capsys.readouterr()
        out = tmp_path / "runs/bad"
        assert cli_main(["reward", *common, "--reward.data", str(bad),
                         "--train.output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err
        assert not out.exists()
    capsys.readouterr()
    assert cli_main(["reward", *common, "--parallel.pp", "2", "--nproc-per-node", "2",
                     "--train.output_dir", str(tmp_path / "runs/pp")]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs/pp").exists()
    assert cli_main(["reward", *common, "--reward.center_rewards_coefficient", "x"]) == 2
