"""A LoRA run out of threefold (``threefold.generation.peft_export``): its adapters as a PEFT folder that
``PeftModel.from_pretrained`` puts on the HF base, and merged into a Hugging Face folder; both
give threefold's LoRA model's logits (``load_for_generation``) to 1e-5 in fp32. The CLI:
``convert --to peft [--merge]``, and the refusals (a LoRA run ``--to hf``, a plain run
``--to peft``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import final_weights, tiny_overrides
from tests.test_sft import OPTIM, TRL_CONVS, base  # noqa: F401
from threefold.commands import convert
from threefold.weights import hf
from threefold.weights import hf_config
from threefold.config import load_config
from threefold.generation.generate import load_for_generation
from threefold.generation.generate import main as generate_main
from threefold.generation.peft_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX,
                                              export_merged, export_peft)
from threefold.post import SFTOptions, SFTTask
from threefold.training.train import train

LORA = {"lora__r": "4", "lora__alpha": "8"}


@pytest.fixture(scope="module")
def lora_run(corpus, cache_dir, base, tmp_path_factory):
    """A 2-step LoRA SFT run (r 4, alpha 8, every linear layer) from the HF base ``base/hf``;
    lr 1e-2 so the adapters move well past the tolerance."""
    root = tmp_path_factory.mktemp("lora")
    path = root / "convs.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in TRL_CONVS))
    over = tiny_overrides(corpus, cache_dir, root / "run", data__seq_len=160,
                          checkpoint__init_from=str(base / "hf"), train__steps=2,
                          train__eval_batches=1, train__global_batch_size=4,
                          train__micro_batch_size=4, **{**OPTIM, "optim__lr": "1e-2"}, **LORA)
    train(load_config(None, over), task=SFTTask(SFTOptions(data=str(path), val_data=str(path))))
    return root / "run"


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))


def _ours(run) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, threefold's logits for them from the run's LoRA model)."""
    model, _, _ = load_for_generation(run)
    ids = _ids(model.cfg.vocab_size)
    with torch.no_grad():
        return ids, model(ids)


def test_peft_adapter_loads_onto_the_hf_base(base, lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    weights = final_weights(lora_run)
    b = [t for k, t in weights.items() if k.endswith("lora_B.weight")]
    assert b and all(t.abs().max() > 0 for t in b)  # the adapters trained
    out = tmp_path / "adapter"
    export_peft(lora_run, out)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    conf = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8.0, "LORA")
    assert conf["base_model_name_or_path"] == str((base / "hf").resolve())
    ids, ours = _ours(lora_run)
    model = transformers.AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float32)
    with torch.no_grad():
        plain = model(ids).logits
    model = peft.PeftModel.from_pretrained(model, out).eval()
    loaded = {k.removeprefix(PEFT_PREFIX).replace(".default", ""): p
              for k, p in model.named_parameters() if "lora_" in k}
    assert set(loaded) == set(weights)
    for k, t in weights.items():
        assert torch.equal(loaded[k].detach(), t), k
    with torch.no_grad():
        theirs = model(ids).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters matter
    assert (ours - theirs).abs().max() <= 1e-5


def test_merged_export_is_a_plain_hf_model(lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "merged"
    export_merged(lora_run, out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    ids, ours = _ours(lora_run)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours - model(ids).logits).abs().max() <= 1e-5
    with pytest.raises(hf_config.HFError, match="not empty"):
        export_merged(lora_run, out)


def test_lora_run_without_init_from_has_the_seed_base(corpus, cache_dir, tmp_path):
    """No checkpoint.init_from: the base is the seed's initial weights, as the trained model
    in memory had them."""
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    _, trained = train(load_config(None, tiny_overrides(
        corpus, cache_dir, run, train__steps=2, train__eval_batches=1,
        lora__target_modules="q_proj,down_proj", **LORA)), return_run=True)
    out = tmp_path / "merged"
    assert convert.main(["--to", "peft", "--merge", str(run), str(out)]) == 0
    ids, ours = _ours(run)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours - trained.engine.model.eval()(ids)).abs().max() <= 1e-5
        assert (ours - model(ids).logits).abs().max() <= 1e-5
    assert convert.main(["--to", "peft", str(run), str(tmp_path / "a")]) == 0
    conf = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert conf["base_model_name_or_path"] is None
    assert conf["target_modules"] == ["down_proj", "q_proj"]


def test_cli_exports_and_refusals(base, lora_run, tmp_path, capsys):
    out = tmp_path / "cli"
    assert convert.main(["--to", "peft", str(lora_run), str(out)]) == 0
    assert (out / ADAPTER_WEIGHTS).is_file() and (out / ADAPTER_CONFIG).is_file()
    assert convert.main(["--to", "peft", str(lora_run), str(out)]) == 2  # not overwritten
    capsys.readouterr()
    assert convert.main(["--to", "hf", str(lora_run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--to peft" in err and "--merge" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()
    assert convert.main(["--to", "peft", str(base / "run"), str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert "lora.r" in err and len(err.strip().splitlines()) == 1
    assert convert.main(["--to", "peft", "--merge", str(base / "hf"), str(tmp_path / "x")]) == 2
    for argv in (["--to", "hf", "--merge", "a", "b"], ["--to", "onnx", "a", "b"],
                 ["--from", "peft", "a", "b"]):
        assert convert.main(argv) == 2, argv
    assert generate_main(["--from", str(lora_run), "--prompt", "Hi", "--max-new-tokens",
                          "2"]) == 0
