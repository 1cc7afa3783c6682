"""Hugging Face export/import: transformers loads an exported run with equal logits and equal
token ids; HF-made models (tied head, Llama 3 RoPE scaling, sharded) import with equal logits;
bad folders are refused by name; an imported folder trains (resume and init_from)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_overrides
from threefold.commands import convert
from threefold.weights import hf
from threefold.weights import hf_config
from threefold.weights.checkpoint_verify import list_checkpoints
from threefold.weights.checkpoint import load_checkpoint
from threefold.config import ModelConfig, load_config
from threefold.model.decoder import CausalLM

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(corpus, cache_dir, tmp_path_factory):
    """A 2-step threefold run and its export to a Hugging Face folder."""
    from threefold.training.train import train

    root = tmp_path_factory.mktemp("hf")
    summary = train(load_config(None, tiny_overrides(corpus, cache_dir, root / "run",
                                                     train__steps=2)))
    assert convert.main(["--to", "hf", str(root / "run"), str(root / "exported")]) == 0
    return root, summary


def _ours_from_checkpoint(run: Path) -> CausalLM:
    step = list_checkpoints(run / "checkpoints")[-1]
    tensors, state = load_checkpoint(run / "checkpoints" / str(step))
    model = CausalLM(ModelConfig(**state["model_config"]))
    model.load_state_dict(tensors["model"], strict=True)
    return model.eval()



def assert_round_trip(tmp_path, ids, want) -> None:
    """``threefold convert --from hf`` of tmp_path/src, then ``--to hf`` again: transformers
    loads the result with the logits ``want`` for ``ids``."""
    import transformers

    assert convert.main(["--from", "hf", str(tmp_path / "src"), str(tmp_path / "tf")]) == 0
    assert convert.main(["--to", "hf", str(tmp_path / "tf"), str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (back(ids).logits - want).abs().max().item() <= 1e-5

def test_export_loads_in_transformers_with_equal_logits_and_tokens(trained):
    root, _ = trained
    out = root / "exported"
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
    assert (conf["hidden_size"], conf["num_key_value_heads"], conf["rope_scaling"]) == (64, 2, None)
    ours = _ours_from_checkpoint(root / "run")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, conf["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-5

    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")
    text = "def f(x):\n    return x + 1  # ünïcode<|endoftext|>next"
    mine = Tokenizer.from_file(str(root / "run" / "tokenizer.json")).encode(text).ids
    assert tok.encode(text) == mine and len(mine) > 5
    assert conf["eos_token_id"] == tok.eos_token_id and tok.eos_token_id in mine
    # A second export into the now non-empty folder is refused, not merged.
    assert convert.main(["--to", "hf", str(root / "run"), str(out)]) == 2


def _perturbed_hf_model(**kw):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, **kw)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so a misplaced norm weight would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5e4}


def test_tied_llama3_model_round_trips(tmp_path):
    theirs = _perturbed_hf_model(tie_word_embeddings=True, rope_parameters=LLAMA3)
    theirs.save_pretrained(tmp_path / "src")
    cfg, weights, tok = hf.import_hf(tmp_path / "src")
    assert (cfg.tie_word_embeddings, cfg.rope_scaling, cfg.rope_scaling_factor) == \
        (True, "llama3", 4.0)
    assert (cfg.rope_theta, cfg.original_max_position_embeddings, tok) == (5e4, 16, None)
    assert "lm_head.weight" not in weights
    ours = CausalLM(cfg).eval()
    hf.init_from_hf(ours, tmp_path / "src")
    # 64 positions: past the original context of 16, where the Llama 3 rescaling matters.
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        assert (ours(ids) - want).abs().max().item() <= 1e-5
        # HF -> threefold checkpoint -> HF again gives the same model to transformers.
        assert_round_trip(tmp_path, ids, want)
    # A wrong RoPE base is named, not loaded into a model that would silently differ.
    other = CausalLM(ModelConfig(**{**vars(cfg), "rope_theta": 1e4}))
    with pytest.raises(hf_config.HFError, match="rope_theta"):
        hf.init_from_hf(other, tmp_path / "src")


@pytest.fixture()
def hf_folders(tmp_path):
    """The same untied model saved whole and sharded."""
    model = _perturbed_hf_model()
    model.save_pretrained(tmp_path / "whole")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    return tmp_path


def test_sharded_index_imports_the_same_tensors(hf_folders):
    shards = sorted(p.name for p in (hf_folders / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (hf_folders / "sharded" / hf_config.INDEX).is_file()
    _, whole, _ = hf.import_hf(hf_folders / "whole")
    cfg, sharded, _ = hf.import_hf(hf_folders / "sharded")
    assert set(whole) == set(sharded) == set(hf_config.expected_shapes(cfg))
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)


def _refused(folder: Path, capsys, *words: str) -> None:
    with pytest.raises(hf_config.HFError) as e:
        hf.import_hf(folder)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    capsys.readouterr()
    assert convert.main(["--from", "hf", str(folder), str(folder.parent / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and words[0] in err


def test_pickle_only_folder_is_refused(hf_folders, capsys):
    folder = hf_folders / "pickled"
    folder.mkdir()
    shutil.copy(hf_folders / "whole" / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    _refused(folder, capsys, "pytorch_model.bin", "pickle")


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/tmp/outside.safetensors",
                                   "sub/../../outside.safetensors", "model.bin"])
def test_index_cannot_point_outside_the_folder(hf_folders, capsys, entry):
    folder = hf_folders / "sharded"
    # A real, valid file sits outside: it must not be read even though it exists.
    save_file({"model.norm.weight": torch.ones(32)}, str(hf_folders / "outside.safetensors"))
    index = json.loads((folder / hf_config.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = entry
    (folder / hf_config.INDEX).write_text(json.dumps(index))
    _refused(folder, capsys, entry)


def test_shape_mismatch_and_truncation_name_file_and_tensor(hf_folders, capsys):
    folder = hf_folders / "whole"
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "intermediate_size": 64}))
    _refused(folder, capsys, "model.safetensors", "mlp.", "(32, 64)")
    (folder / "config.json").write_text(json.dumps(conf))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    _refused(folder, capsys, "model.safetensors", "truncated")


@pytest.mark.parametrize("change,field", [
    ({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 15}, "head_dim"), ({"model_type": "granite"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
])
def test_unsupported_configs_are_named(change, field):
    base = _perturbed_hf_model().config.to_dict()
    assert hf_config.model_config_from_hf(base).hidden_size == 32
    with pytest.raises(hf_config.HFError, match=field) as e:
        hf_config.model_config_from_hf({**base, **change})
    assert "\n" not in str(e.value)


def test_convert_from_hf_then_training_starts_from_it(trained, corpus, cache_dir, capsys):
    from threefold.training.train import build_run, train
    from threefold.training.steps import evaluate, train_step

    root, first = trained
    imp = root / "imported"
    assert convert.main(["--from", "hf", str(root / "exported"), str(imp)]) == 0
    assert list_checkpoints(imp / "checkpoints") == [0] and (imp / "tokenizer.json").is_file()
    assert convert.main(["--from", "hf", str(root / "exported"), str(imp)]) == 2  # not overwritten
    # Resume: the imported weights score exactly what the run that made them scored.
    again = train(load_config(None, tiny_overrides(corpus, cache_dir, imp, train__steps=2,
                                                   checkpoint__resume="true")))
    assert again["resumed_from_step"] == 0
    assert again["initial_validation_loss"] == pytest.approx(first["validation_loss"], abs=1e-6)
    assert again["validation_loss"] < again["initial_validation_loss"]
    # init_from: a fresh run loads the weights (strictly) before its first step.
    run = build_run(load_config(None, tiny_overrides(corpus, cache_dir, root / "fresh")))
    assert evaluate(run)[0] != pytest.approx(first["validation_loss"], abs=1e-3)
    hf.init_from_hf(run.engine.model, root / "exported")
    assert evaluate(run)[0] == pytest.approx(first["validation_loss"], abs=1e-6)
    loss, _, _ = train_step(run, 0)
    assert torch.isfinite(torch.tensor(loss))
    # init_from also takes a threefold run directory: its newest checkpoint (the resumed run's).
    hf.init_from_hf(run.engine.model, imp)
    assert evaluate(run)[0] == pytest.approx(again["validation_loss"], abs=1e-6)
    # Bad command lines: one line on stderr, exit 2.
    capsys.readouterr()
    for argv in (["--to", "onnx", "a", "b"], ["--from", "hf", str(root / "nope"), "x"], ["a"]):
        assert convert.main(argv) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_transformers_4_style_rope_fields_import():
    base = _perturbed_hf_model().config.to_dict()
    base.pop("rope_parameters")
    legacy = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    cfg = hf_config.model_config_from_hf({**base, "rope_theta": 5e4, "rope_scaling": legacy})
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor) == (5e4, "llama3", 4.0)
    assert hf_config.model_config_from_hf({**base, "rope_theta": 2e4}).rope_scaling == "none"
    # Export writes both spellings, which read back the same.
    conf = hf_config.hf_config(cfg)
    assert hf_config.model_config_from_hf({**conf, "rope_parameters": None}) == cfg
    assert hf_config.model_config_from_hf(conf) == cfg
