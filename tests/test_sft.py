"""SFT: the chat template and its assistant mask, packing and sampling, packed rows computed
as conversations alone, step losses equal to TRL's SFTTrainer, every layout equal to one
process, HF export, and `threefold sft` out of the box after `threefold train`."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import final_weights, metrics, tiny_overrides
from tests.dist import run_distributed, train_runs
from threefold.config import load_config
from threefold.data import DataError, prepare_data
from threefold.data.chat import (BUILTIN_TEMPLATE, BuiltinTemplate, JinjaTemplate,
                                 encode_conversation, load_chat_template)
from threefold.post.sft import PackedSampler, epoch_order, pack, to_conversation
from threefold.post import SFTOptions, SFTTask, example_path
from threefold.training.train import train

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."}]


@pytest.fixture(scope="module")
def data(corpus, cache_dir):
    """The tiny runs' tokenizer and token stream (BPE of 320, cached)."""
    return prepare_data(load_config(None, tiny_overrides(corpus, cache_dir, "x")).data)


# The built-in format as an HF folder would ship it; the comment makes it another text, so the
# folder's template is rendered by jinja2 (the built-in one is rendered in Python).
HF_TEMPLATE = "{# threefold's built-in chat format #}" + BUILTIN_TEMPLATE


@pytest.fixture(scope="module")
def base(corpus, cache_dir, tmp_path_factory) -> Path:
    """A pretrained starting point: ``base/run``, a 1-step threefold run of the tiny model,
    and ``base/hf``, its Hugging Face export whose tokenizer_config.json carries HF_TEMPLATE."""
    from threefold.weights.hf import export_hf

    root = tmp_path_factory.mktemp("base")
    train(load_config(None, tiny_overrides(corpus, cache_dir, root / "run", train__steps=1,
                                           train__eval_batches=1)))
    export_hf(root / "run", root / "hf")
    conf_path = root / "hf" / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    conf["chat_template"] = HF_TEMPLATE
    conf_path.write_text(json.dumps(conf))
    return root


# --------------------------------------------------------------------------------------------
# Template, mask, records
# --------------------------------------------------------------------------------------------
def test_builtin_template_format_mask_and_jinja_twin(data, tmp_path):
    tpl = load_chat_template(data.tokenizer_path, data.tokenizer)  # no tokenizer_config.json
    assert isinstance(tpl, BuiltinTemplate)
    assert tpl.render(CONV[:2], add_generation_prompt=True) == \
        "<|system|>\nBe brief.<|endoftext|><|user|>\nWhat is 2+2?<|endoftext|><|assistant|>\n"
    enc = encode_conversation(tpl, data.tokenizer, CONV)
    tok = data.tokenizer
    trained = [i for i, t in zip(enc.ids, enc.trained) if t]
    # exactly the assistants' contents and the end-of-text closing each of their turns
    assert tok.decode(trained, skip_special_tokens=False) == "4.<|endoftext|>It is 6.<|endoftext|>"
    assert enc.ids == tok.encode(tpl.render(CONV), add_special_tokens=False).ids
    assert sum(1 for i in enc.ids if i == data.eot_id) == 5
    pytest.importorskip("jinja2")
    twin = JinjaTemplate(BUILTIN_TEMPLATE, {"eos_token": "<|endoftext|>"}, "test")
    for n in range(len(CONV) + 1):
        for gen in (False, True):
            assert twin.render(CONV[:n], gen) == tpl.render(CONV[:n], gen)
    # a folder's template: tokenizer_config.json (named templates too), else chat_template.jinja
    shutil.copyfile(data.tokenizer_path, tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(BUILTIN_TEMPLATE)  # as an SFT run saves it
    assert isinstance(load_chat_template(tmp_path / "tokenizer.json", tok), BuiltinTemplate)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"},
         "chat_template": [{"name": "default", "template": HF_TEMPLATE}]}))
    hf = load_chat_template(tmp_path / "tokenizer.json", tok)
    assert isinstance(hf, JinjaTemplate) and hf.source.endswith("tokenizer_config.json")
    assert hf.render(CONV, True) == tpl.render(CONV, True)
    assert isinstance(load_chat_template(tmp_path / "tokenizer.json", tok, "builtin"),
                      BuiltinTemplate)


def test_bad_records_and_templates_are_refused(data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    cfg = load_config(None, [("data.seq_len", "64")])
    for line, msg in ((json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                       "no assistant"),
                      (json.dumps({"messages": [{"role": "user"}]}), "string 'role'"),
                      ("{not json", "not valid JSON")):
        bad.write_text(json.dumps({"messages": CONV}) + "\n" + line + "\n")
        task = SFTTask(SFTOptions(data=str(bad), val_data=str(bad)))
        with pytest.raises(DataError, match=msg) as e:
            task.samplers(cfg, data)
        assert "bad.jsonl:2" in str(e.value)
    pytest.importorskip("jinja2")
    # a template that renders the last message differently cannot be split into turns
    unstable = JinjaTemplate("{% for m in messages %}{% if loop.last %}LAST:{% endif %}"
                             "{{ m['content'] }}|{% endfor %}", {}, "t")
    with pytest.raises(DataError, match="prefix"):
        encode_conversation(unstable, data.tokenizer, CONV)


# --------------------------------------------------------------------------------------------
# Packing and sampling
# --------------------------------------------------------------------------------------------
def test_pack_and_sampler_are_deterministic_exact_and_resumable():
    lengths = [7, 3, 5, 5, 2, 8, 2, 3]
    rows = pack(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(8))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == math.ceil(sum(lengths) / 10)  # 35 tokens: 4 rows, none wasted here
    convs = [to_conversation(list(range(10 * i, 10 * i + n)), [j % 2 == 1 for j in range(n)], 10)
             for i, n in enumerate(lengths)]
    s = PackedSampler(convs, 10, 4, seed=3, pad_id=999)
    b = s.item(0)
    doc = b["document_ids"]
    for d in set(doc.tolist()):  # positions restart per document
        assert b["position_ids"][doc == d].tolist() == list(range(int((doc == d).sum())))
    # every label is the next token of the same document, at odd in-document positions
    ok = b["labels"] != -100
    assert (b["labels"][:-1][ok[:-1]] == b["input_ids"][1:][ok[:-1]]).all()
    assert (doc[:-1][ok[:-1]] == doc[1:][ok[:-1]]).all()
    # one epoch = every row once, in a (seed, epoch)-determined order
    seen = s.local_batch(0, 0, 1)["input_ids"]
    assert sorted(seen[:, 0].tolist()) == sorted(s.item(i)["input_ids"][0] for i in range(4))
    assert sorted(epoch_order(3, 1, 10)) == list(range(10)) != epoch_order(3, 1, 10)
    assert epoch_order(3, 0, 10) != epoch_order(3, 1, 10)
    # data-parallel slices are the global batch's rows, computed alone
    for step in range(3):
        whole = s.local_batch(step, 0, 1)
        halves = [s.local_batch(step, r, 2) for r in range(2)]
        for k in whole:
            assert torch.equal(whole[k], torch.cat([h[k] for h in halves]))
    state = s.state_dict()
    assert state["step"] == 3
    other = PackedSampler(convs, 10, 4, seed=0, pad_id=999)
    other.load_state_dict(state)
    assert torch.equal(other.local_batch(5, 0, 1)["labels"], s.local_batch(5, 0, 1)["labels"])
    with pytest.raises(DataError, match="fingerprint"):
        PackedSampler(convs[:-1], 10, 4, seed=3, pad_id=999).load_state_dict(state)
    # validation: rows in order, then empty rows without targets
    v = PackedSampler(convs, 10, 3, seed=3, pad_id=999, shuffle=False)
    assert (v.local_batch(1, 0, 1)["labels"][1:] == -100).all()


def test_packed_rows_compute_each_conversation_as_if_alone(data):
    from threefold.model.decoder import CausalLM, causal_lm_loss

    cfg = load_config(None, tiny_overrides("c", "c", "x", data__seq_len=256))
    task = SFTTask(SFTOptions(data=str(example_path("sft.jsonl"))))
    sampler, _ = task.samplers(cfg, data)
    model = CausalLM(cfg.model.resolved(data.vocab_size))
    model.init_weights(seed=0)
    row = sampler.local_batch(0, 0, 4)  # 2 of the step's 8 rows
    with torch.no_grad():
        packed = causal_lm_loss(model(row["input_ids"], row["position_ids"],
                                      row["document_ids"]), row["labels"])
        alone = 0.0
        for r in range(row["input_ids"].shape[0]):
            for c in sampler.rows[sampler.indices(0, r, r + 1)[0]]:  # rank 0's rows 0 and 1
                conv = sampler.convs[c]
                ids = torch.from_numpy(conv.ids)[None]
                alone += causal_lm_loss(model(ids), torch.from_numpy(conv.labels)[None]).item()
    assert packed.item() == pytest.approx(alone, rel=1e-5)
    assert task.count(row) == int((row["labels"] != -100).sum()) > 0


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------
TRL_CONVS = [CONV,
             [{"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "Blue."}],
             [{"role": "user", "content": "Say hello in French."},
              {"role": "assistant", "content": "Bonjour! It means hello."}],
             [{"role": "system", "content": "You answer with one word."},
              {"role": "user", "content": "Opposite of up?"},
              {"role": "assistant", "content": "Down."}]]
OPTIM = {"optim__lr": "1e-3", "optim__warmup_steps": "0", "optim__min_lr_ratio": "1.0",
         "optim__weight_decay": "0.0", "optim__beta1": "0.9", "optim__beta2": "0.95",
         "optim__grad_clip": "1.0", "optim__eps": "1e-6"}


def trl_stack():
    """(trl, datasets, transformers), skipping the test where TRL's stack is not installed."""
    pytest.importorskip("jinja2")
    return tuple(pytest.importorskip(m) for m in ("trl", "datasets", "transformers"))


def trl_args(cls, out: Path, batch: int, seq_len: int, **extra):
    """TRL config matching OPTIM: constant lr, AdamW(0.9, 0.95, 1e-6), no decay, clip 1; fp32
    (TRL's configs default to bf16 autocast where the device has it, the CPU included)."""
    return cls(output_dir=str(out), per_device_train_batch_size=batch, max_steps=2,
               learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0,
               weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6,
               max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no",
               use_cpu=True, seed=0, max_length=seq_len, disable_tqdm=True,
               dataloader_drop_last=False, bf16=False, fp16=False,
               gradient_checkpointing=False, **extra)


def test_sft_step_losses_equal_trl(corpus, cache_dir, base, tmp_path):
    """Same HF model, weights, chat template and conversations: the loss of the first step
    (before any update) and of the second (after one AdamW step) equal SFTTrainer's."""
    trl, datasets, transformers = trl_stack()
    hf_dir = base / "hf"
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in TRL_CONVS))
    seq_len = 160
    over = tiny_overrides(corpus, cache_dir, tmp_path / "ours", data__seq_len=seq_len,
                          checkpoint__init_from=str(hf_dir), train__steps=2,
                          train__eval_batches=1, **OPTIM)
    # one global batch = every packed row once, as TRL's batch = every conversation
    task = SFTTask(SFTOptions(data=str(path), val_data=str(path)))
    probe = load_config(None, over)
    probe.data.tokenizer = str(hf_dir / "tokenizer.json")
    rows = task.samplers(probe, prepare_data(probe.data))[0].n
    assert task.stats["template"].endswith("tokenizer_config.json")  # the HF folder's template
    cfg = load_config(None, over + [("train.global_batch_size", str(rows)),
                                    ("train.micro_batch_size", str(rows))])
    train(cfg, task=SFTTask(SFTOptions(data=str(path), val_data=str(path))))
    ours = [r["loss"] for r in metrics(tmp_path / "ours")]
    assert (tmp_path / "ours" / "chat_template.jinja").read_text() == HF_TEMPLATE

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"messages": m} for m in TRL_CONVS])
    args = trl_args(trl.SFTConfig, tmp_path / "trl", len(TRL_CONVS), seq_len,
                    assistant_only_loss=True, packing=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == 2
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert abs(ours[1] - ours[0]) > 1e-2  # the second step really saw the update


# --------------------------------------------------------------------------------------------
# Layouts, export, CLI
# --------------------------------------------------------------------------------------------
SFT_STEPS = 2


def post_overrides(corpus, cache, out, **extra):
    """A short post-training run (SFT here, DPO in test_dpo) of the tiny model."""
    return tiny_overrides(corpus, cache, out, data__seq_len=128, train__steps=SFT_STEPS,
                          train__eval_batches=1, **extra)


# ZeRO-3 x 2 with accumulation runs in test_dpo; here what packing meets in each layout:
# split rows (DP), vocab-parallel loss and sequence-sharded activations (TP + SP), document ids
# and positions handed between stages (PP).
RUNS = [("dp2_accum", {"train__micro_batch_size": 2}),
        ("tp2_sp", {"parallel__tp": 2, "parallel__sequence_parallel": "true"}),
        ("pp2_1f1b", {"parallel__pp": 2, "train__micro_batch_size": 2})]


@pytest.mark.slow
def test_sft_layouts_equal_single_process_and_export(corpus, cache_dir, tmp_path):
    from threefold.weights.hf import export_hf

    train(load_config(None, post_overrides(corpus, cache_dir, tmp_path / "single")),
          task=SFTTask())
    ref = metrics(tmp_path / "single")
    assert [r["step"] for r in ref] == list(range(1, SFT_STEPS + 1))
    assert ref[-1]["loss"] < ref[0]["loss"]
    run_distributed(train_runs, 2, functools.partial(post_overrides, corpus, cache_dir),
                    tmp_path, RUNS, SFTTask, timeout=300)
    ref_w = final_weights(tmp_path / "single")
    for name, _ in RUNS:
        assert [r["loss"] for r in metrics(tmp_path / name)] == \
            pytest.approx([r["loss"] for r in ref], rel=1e-5), name
        w = final_weights(tmp_path / name)
        for k, v in ref_w.items():
            torch.testing.assert_close(w[k], v, rtol=1e-4, atol=2e-5, msg=f"{name}: {k}")
    # the SFT checkpoint exports to a Hugging Face folder holding its weights
    export_hf(tmp_path / "single", tmp_path / "hf")
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(exported["model.norm.weight"], ref_w["model.norm.weight"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"


def test_sft_cli_out_of_the_box_after_train(corpus, cache_dir, base, tmp_path, monkeypatch):
    """`threefold train` then `threefold sft` with no data or init option: runs/default ->
    runs/sft on the built-in examples; resuming continues; bad options fail in one line."""
    from threefold.commands.posttrain import sft_main

    monkeypatch.chdir(tmp_path)
    shutil.copytree(base / "run", "runs/default")  # what `threefold train` leaves
    common = ["--data.corpus", str(corpus), "--data.cache_dir", str(cache_dir),
              "--train.progress", "off"]
    assert sft_main(common + ["--train.steps", "2", "--checkpoint.interval", "1"]) == 0
    recs = metrics(tmp_path / "runs/sft")
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    cfg = json.loads((tmp_path / "runs/sft/config.json").read_text())
    assert cfg["checkpoint"]["init_from"] == "runs/default" and cfg["train"]["steps"] == 2
    assert (tmp_path / "runs/sft/checkpoints/2").is_dir()
    assert (tmp_path / "runs/sft/chat_template.jinja").read_text() == BUILTIN_TEMPLATE
    # resume to step 3 from the step-2 checkpoint
    assert sft_main(common + ["--train.steps", "3", "--checkpoint.resume", "true"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "runs/sft")] == [1, 2, 3]
    assert sft_main(common + ["--sft.nope", "1"]) == 2
    assert sft_main(common + ["--sft.data", "missing.jsonl"]) == 2
    shutil.rmtree(tmp_path / "runs/default")
    assert sft_main(common + ["--train.output_dir", "runs/other"]) == 2
