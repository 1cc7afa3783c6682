"""DPO: the loss formula, pair tokenization, step-0 loss of ln 2 with TRL's metric names,
step losses and log-probs equal to TRL's DPOTrainer, DP2, ZeRO-3 and cp 2 equal to one process,
HF export, and `threefold dpo` out of the box after `threefold train`."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from tests.test_sft import (OPTIM, base, data, post_overrides, trl_args,  # noqa: F401
                             trl_stack)
from threefold.config import load_config
from threefold.data import DataError
from threefold.data.chat import BuiltinTemplate
from threefold.post import DPOOptions, DPOTask, dpo_loss
from threefold.post.dpo import sequence, tokenize_pair
from threefold.training.train import train

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LN2 = math.log(2)


def test_loss_is_sigmoid_dpo_with_conservative_label_smoothing():
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g,
                                                                           dtype=torch.float64)
    for beta in (0.1, 0.5):
        for eps in (0.0, 0.1, 0.3):
            z = beta * (c - r)
            # −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ), σ written out
            want = -(1 - eps) * torch.log(1 / (1 + torch.exp(-z))) \
                - eps * torch.log(1 / (1 + torch.exp(z)))
            torch.testing.assert_close(dpo_loss(c, r, beta, eps), want)
            zero = dpo_loss(torch.zeros(3), torch.zeros(3), beta, eps)
            torch.testing.assert_close(zero, torch.full((3,), LN2))
    # gradient: raising the chosen log-ratio lowers the loss (ε < 0.5)
    x = torch.zeros(1, requires_grad=True)
    dpo_loss(x, torch.zeros(1), 0.1, 0.2).sum().backward()
    assert x.grad.item() == pytest.approx(-0.1 * 0.5 * (1 - 2 * 0.2))
    assert dpo_loss(c, r, 0.1)[0].item() == pytest.approx(-F.logsigmoid(0.1 * (c - r))[0].item())


def test_pairs_tokenize_like_trl_and_label_only_the_response(data):
    tok, eot = data.tokenizer, "<|endoftext|>"
    tpl = BuiltinTemplate(eot)
    p, c, r = tokenize_pair({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"},
                            tpl, tok, eot, "t")
    assert tok.decode(p + c, skip_special_tokens=False) == "Q: 2+2?\nA: 4<|endoftext|>"
    assert tok.decode(r, skip_special_tokens=False).endswith("5<|endoftext|>")
    msgs = {"prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "assistant", "content": "Go away."}]}
    p, c, r = tokenize_pair(msgs, tpl, tok, eot, "t")
    assert tok.decode(p, skip_special_tokens=False) == "<|user|>\nHi<|endoftext|><|assistant|>\n"
    assert tok.decode(c, skip_special_tokens=False) == "Hello!<|endoftext|>"
    x, y = sequence(p, c, 64, pad=1)
    targets = y[y != -100].tolist()
    assert targets == c and x[len(p) + len(c):].tolist() == [1] * (64 - len(p) - len(c))
    assert (y[:len(p) - 1] == -100).all()  # no loss on the prompt
    x, y = sequence(p, c, len(p) + 2, pad=1)  # cut: keep the start, 2 response tokens
    assert y[y != -100].tolist() == c[:2]
    with pytest.raises(DataError, match="no 'rejected'"):
        tokenize_pair({"prompt": "a", "chosen": "b"}, tpl, tok, eot, "t")
    with pytest.raises(DataError, match="all be strings"):
        tokenize_pair({"prompt": "a", "chosen": "b", "rejected": msgs["rejected"]}, tpl, tok,
                      eot, "t")


def write_pairs(root):
    """12 of the built-in pairs for training and 2 for validation, to keep scoring short."""
    from threefold.post import example_path

    pairs = example_path("dpo.jsonl").read_text().splitlines()
    (root / "train.jsonl").write_text("\n".join(pairs[:12]) + "\n")
    (root / "val.jsonl").write_text("\n".join(pairs[-2:]) + "\n")


def dpo_task(root):
    """β 0.5, ε 0.1 on the pairs of ``write_pairs``."""
    return DPOTask(DPOOptions(data=str(root / "train.jsonl"), val_data=str(root / "val.jsonl"),
                              beta=0.5, label_smoothing=0.1))


RUNS = [("dp2", {}), ("zero3_accum", {"parallel__zero_stage": 3, "train__micro_batch_size": 2}),
        ("pp2_1f1b", {"parallel__pp": 2, "train__micro_batch_size": 1}),
        ("cp2", {"parallel__cp": 2})]


def _dpo_cp_bytes(rows: int, seq_len: int) -> int:
    """Bytes a rank sends on "cp" per DPO step of one micro-batch of ``rows`` (chosen and
    rejected) rows under ring cp 2 over the tiny model's 2 blocks: each attention's closed
    form, and the log-probs' sum over cp forward and its gradient's backward (all-reduces of
    ``rows`` fp32, each rank sending the half it does not own, twice)."""
    from threefold.accounting import cp_bytes_per_attention

    kv = 2 * rows * 2 * (seq_len // 2) * 16 * 4  # K and V: rows · 2 kv heads · T/2 · 16, fp32
    fwd, bwd = cp_bytes_per_attention(kv, 2, "ring")
    return 2 * (fwd + bwd) + 2 * (2 * (rows // 2) * 4)


@pytest.mark.slow
def test_dpo_step0_is_ln2_learns_and_layouts_equal_single_process(corpus, cache_dir, tmp_path):
    from threefold.weights.hf import export_hf

    write_pairs(tmp_path)
    summary = train(load_config(None, post_overrides(corpus, cache_dir, tmp_path / "single")),
                    task=dpo_task(tmp_path))
    ref = metrics(tmp_path / "single")
    first = ref[0]
    assert set(KEYS) <= set(first) and "logps/chosen" in first
    # policy = reference at step 0: Δ = 0 exactly, loss ln 2 for any β and ε, rewards 0
    assert first["loss"] == pytest.approx(LN2, abs=1e-6)
    assert summary["initial_validation_loss"] == pytest.approx(LN2, abs=1e-6)
    assert [first[k] for k in KEYS[1:]] == [0.0, 0.0, 0.0, 0.0]
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    last = ref[-1]
    assert last["loss"] < LN2 and last["rewards/margins"] > 0
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"]
                                                    - last["rewards/rejected"], abs=1e-6)
    run_distributed(train_runs, 2, functools.partial(post_overrides, corpus, cache_dir),
                    tmp_path, RUNS, functools.partial(dpo_task, tmp_path), timeout=300)
    ref_w = final_weights(tmp_path / "single")
    for name, _ in RUNS:
        got = metrics(tmp_path / name)
        for k in KEYS + ("logps/chosen",):
            # rewards are β × differences of summed fp32 log-probs (~100): compare them to
            # 1e-4 absolute, i.e. the log-probs to ~1e-6 relative
            tol = {"abs": 1e-4} if k.startswith("rewards/") else {"rel": 1e-5}
            assert [r[k] for r in got] == pytest.approx([r[k] for r in ref], **tol), (name, k)
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    # DPO under cp 2: every step moves the closed form's bytes (one micro-batch of 8 pairs)
    assert {r["comm_bytes"]["cp"] for r in metrics(tmp_path / "cp2")} == {_dpo_cp_bytes(16, 128)}
    export_hf(tmp_path / "dp2", tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def _deep_overrides(corpus, cache, out, **extra):
    """``post_overrides`` with 4 blocks (a V of 2 ranks has 4 chunks) and micro-batches of 1."""
    return post_overrides(corpus, cache, out, model__num_hidden_layers=4,
                          train__micro_batch_size=1, **extra)


@pytest.mark.slow
def test_dpo_in_a_v_equals_single_process(corpus, cache_dir, tmp_path):
    """DPO through ZB-V (pp 2, two chunks per rank): the reference log-probs come from rank
    0, which holds the last stage in a V, and every rank trains on the same ones."""
    write_pairs(tmp_path)
    overrides = functools.partial(_deep_overrides, corpus, cache_dir)
    train(load_config(None, overrides(tmp_path / "single")), task=dpo_task(tmp_path))
    runs = [("pp2_zbv", {"parallel__pp": 2, "parallel__vpp": 2, "parallel__schedule": "zb-v"})]
    run_distributed(train_runs, 2, overrides, tmp_path, runs,
                    functools.partial(dpo_task, tmp_path), timeout=300)
    ref, got = metrics(tmp_path / "single"), metrics(tmp_path / "pp2_zbv")
    for k in ("loss", "logps/chosen"):
        assert [r[k] for r in got] == pytest.approx([r[k] for r in ref], rel=1e-5), k
    ref_w, w = final_weights(tmp_path / "single"), final_weights(tmp_path / "pp2_zbv")
    for k, v in ref_w.items():
        torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=k)


TRL_PAIRS = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}],
     "chosen": [{"role": "assistant", "content": "It is 4."}],
     "rejected": [{"role": "assistant", "content": "It is 5, I think."}]},
    {"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
     "chosen": [{"role": "assistant", "content": "Hello there!"}],
     "rejected": [{"role": "assistant", "content": "What?"}]},
    {"prompt": [{"role": "user", "content": "Colour of grass?"}],
     "chosen": [{"role": "assistant", "content": "Green."}],
     "rejected": [{"role": "assistant", "content": "Purple."}]},
]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_step_losses_and_logps_equal_trl(corpus, cache_dir, base, tmp_path, loss_type):
    """Same HF model, weights, template and pairs: TRL's DPOTrainer (reference = a frozen copy
    of the model) and ours (precomputed reference) log the same loss and log-probs at the
    first step and, after one AdamW update, the same loss and rewards at the second, for each
    of TRL's loss types we take (IPO's log-ratios per response token)."""
    trl, datasets, transformers = trl_stack()
    hf_dir = base / "hf"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in TRL_PAIRS))
    n, seq_len, beta = len(TRL_PAIRS), 96, 0.5
    cfg = load_config(None, tiny_overrides(
        corpus, cache_dir, tmp_path / "ours", data__seq_len=seq_len, train__steps=2,
        checkpoint__init_from=str(hf_dir), train__global_batch_size=n,
        train__micro_batch_size=n, train__eval_batches=1, **OPTIM))
    train(cfg, task=DPOTask(DPOOptions(data=str(path), val_data=str(path), beta=beta,
                                       loss_type=loss_type)))
    ours = metrics(tmp_path / "ours")

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    args = trl_args(trl.DPOConfig, tmp_path / "trl", n, seq_len, beta=beta,
                    loss_type=[loss_type])
    trainer = trl.DPOTrainer(model=model, args=args, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(TRL_PAIRS))
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == 2
    step0 = {"sigmoid": LN2, "ipo": (1 / (2 * beta)) ** 2, "hinge": 1.0}[loss_type]
    assert ours[0]["loss"] == pytest.approx(step0, abs=1e-6)
    for k in ("loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
              "rewards/margins", "rewards/accuracies"):
        assert [r[k] for r in ours] == pytest.approx([h[k] for h in theirs], abs=1e-4), k
    assert abs(ours[1]["loss"] - step0) > 1e-3  # the second step really saw the update


def test_dpo_cli_out_of_the_box_after_train(corpus, cache_dir, base, tmp_path, monkeypatch):
    """`threefold train` then `threefold dpo` with no data or init option: runs/default ->
    runs/dpo on the built-in pairs; bad options fail in one line."""
    import shutil

    from threefold.commands.posttrain import dpo_main

    monkeypatch.chdir(tmp_path)
    shutil.copytree(base / "run", "runs/default")  # what `threefold train` leaves
    common = ["--data.corpus", str(corpus), "--data.cache_dir", str(cache_dir),
              "--train.progress", "off"]
    assert dpo_main(common + ["--train.steps", "2", "--dpo.beta", "0.2",
                              "--data.seq_len", "128"]) == 0
    recs = metrics(tmp_path / "runs/dpo")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[0]["loss"] == pytest.approx(LN2, abs=1e-6)
    assert all(set(KEYS) <= set(r) for r in recs)
    assert (tmp_path / "runs/dpo/checkpoints/2").is_dir()
    assert (tmp_path / "runs/dpo/chat_template.jinja").is_file()
    assert dpo_main(common + ["--dpo.label_smoothing", "0.5"]) == 2
    assert dpo_main(common + ["--dpo.beta", "abc"]) == 2
