"""Multi-token prediction (threefold.model.mtp): the modules compute DeepSeek-V3's definition,
their loss enters the step through the model's hook, a DeepSeek-V3 folder that carries them
converts both ways, and the planner counts them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_pipeline import _one_thread  # noqa: F401 (its autouse fixture: one thread)
from threefold.config import ModelConfig

SHAPE = dict(preset="tiny", vocab_size=96, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_nextn_predict_layers=2, mtp_loss_weight=0.3)


def _model(**over):
    from threefold.model.decoder import CausalLM

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{**SHAPE, **over}).resolved())
    with torch.no_grad():  # norms away from 1 so that each one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def _reference(model, ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's summed cross-entropy, written from the paper's equations: module k at
    position i projects [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)], runs its block, and
    predicts t_{i+k+1} through its own norm and the shared head."""
    from threefold.model.decoder import DecoderLayer

    cfg, inner = model.cfg, model.model
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    cos, sin = inner.rotary(pos)
    h = inner.embed_tokens(ids)
    for layer in inner.layers[:cfg.num_hidden_layers]:
        h = layer(h, cos, sin)
    out = []
    for k in range(1, cfg.num_nextn_predict_layers + 1):
        mod = inner.layers[cfg.num_hidden_layers + k - 1]
        n = t - k  # positions whose token k ahead exists
        e = inner.embed_tokens(ids[:, k:])
        x = mod.eh_proj(torch.cat([mod.enorm(e), mod.hnorm(h[:, :n])], -1))
        # the block alone (its DecoderLayer forward), on the first n positions: causal
        h = DecoderLayer.forward(mod, x, cos[:, :n], sin[:, :n])
        logits = model.lm_head.weight @ mod.shared_head.norm(h).transpose(1, 2)
        out.append(F.cross_entropy(logits.transpose(1, 2).flatten(0, 1),
                                   labels[:, k:].flatten(), ignore_index=-100,
                                   reduction="sum"))
    return out


def test_modules_follow_the_paper_and_their_loss_enters_through_the_model_hook():
    from threefold.model.moe import RouterLog
    from threefold.model.mtp import is_mtp

    model = _model()
    names = [n for n, _ in model.named_parameters() if n.startswith("model.layers.3.")]
    assert {"model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
            "model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.self_attn.q_proj.weight"} <= set(names)
    assert [is_mtp(m) for m in model.model.layers] == [False, False, True, True]
    ids = torch.randint(0, 96, (2, 12))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[0, 3] = -100  # an ignored target is ignored at every depth
    main = model(ids, labels=labels)
    got = model.mtp_losses
    want = _reference(model, ids, labels)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # the main model's loss is the model without the modules'
    with torch.no_grad():
        logits = model(ids)
    torch.testing.assert_close(main, F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                     reduction="none").view(2, 12)
                               * (labels != -100))
    # the step's hook: λ/D times the depths' total, logged unweighted per depth and token
    log = RouterLog(model.cfg, model)
    term = log.add(model, 999)
    torch.testing.assert_close(term, 0.3 / 2 * (want[0] + want[1]), rtol=1e-5, atol=1e-5)
    assert log.add(model, 999) is None  # taken once
    n = int((labels != -100).sum())
    assert log.metrics(n)["mtp_loss"] == pytest.approx(float((want[0] + want[1]).detach()) / n / 2,
                                                       rel=1e-5)
    # gradients reach the modules and the shared embedding through the term
    term.backward()
    assert model.model.layers[3].eh_proj.weight.grad.abs().max() > 0
    assert model.model.embed_tokens.weight.grad.abs().max() > 0
    # evaluation and generation run no module: nothing recorded, no grad needed
    with torch.no_grad():
        model(ids, labels=labels)
    assert model.mtp_losses is None
    # a task whose objective is not the next tokens' (DPO, GRPO) takes and drops them
    model(ids, labels=labels)
    other = RouterLog(model.cfg, model, next_token=False)
    assert other.add(model, 999) is None and model.mtp_losses is None
    assert "mtp_loss" not in other.metrics(n)


def _deepseek_folder_with_mtp(folder):
    """transformers' tiny DeepSeek-V3 (tests/test_deepseek.py) saved, then given the module
    as DeepSeek's checkpoint stores it: layer L with a routed block of its own (random),
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the copies of the embedding
    and the head. Returns transformers' model and the folder's tensors."""
    from safetensors.torch import load_file, save_file

    from tests.test_deepseek import hf_deepseek

    hf = hf_deepseek()
    hf.save_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    assert [f.name for f in files] == ["model.safetensors"]
    tensors = load_file(files[0])
    gen = torch.Generator().manual_seed(1)
    last, h = hf.config.num_hidden_layers - 1, hf.config.hidden_size
    p = f"model.layers.{last + 1}."
    for name, t in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            tensors[p + name.split(".", 3)[3]] = torch.randn(t.shape, generator=gen) * 0.1
    tensors.update({p + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
                    p + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
                    p + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen),
                    p + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, files[0], metadata={"format": "pt"})
    return hf, tensors


def test_deepseek_folder_with_its_module_imports_and_exports_exactly(tmp_path):
    """A DeepSeek-V3 folder that carries its module (layer L) converts to a run and back:
    the main model's logits are transformers' (which ignores the module), every tensor of
    the folder comes back exactly, the copies of the embedding and head included, and the
    module's loss is computed from the folder's weights. A folder whose copy of the
    embedding differs from the embedding is refused."""
    from safetensors.torch import load_file, save_file

    from threefold.commands.convert import main as convert
    from threefold.model.decoder import CausalLM
    from threefold.weights.hf import import_hf, load_pretrained
    from threefold.weights.hf_config import HFError

    pytest.importorskip("transformers")
    hf, tensors = _deepseek_folder_with_mtp(tmp_path / "hf")
    cfg, weights = load_pretrained(tmp_path / "hf")
    assert cfg.num_nextn_predict_layers == 1 and "model.layers.3.eh_proj.weight" in weights
    assert "model.layers.3.embed_tokens.weight" not in weights  # the model's own is used
    model = CausalLM(cfg)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, rtol=0, atol=1e-5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    model(ids, labels=labels)
    torch.testing.assert_close(model.mtp_losses[0], _reference(model, ids, labels)[0],
                               rtol=1e-5, atol=1e-4)
    assert convert(["--from", "hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert convert(["--to", "hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    back = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        back.update(load_file(f))
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    # a copy that is not the model's embedding: refused, naming it
    tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="model.layers.3.embed_tokens.weight differs"):
        import_hf(tmp_path / "hf")


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_kept_bytes_equal_autograd_saved_tensors(recompute, monkeypatch):
    """What the modules keep for backward (``mtp_activation_bytes``) is, to the byte, what
    autograd saves, and selective recompute's blocks keep, beyond the same model without
    them (fp32; weights excluded), under each recompute: D = 2, so depth 2's input is a
    module's output."""
    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Layout, Workload
    from threefold.parallel.transforms import recompute as transform
    from threefold.plan.mtp_bytes import mtp_activation_bytes

    keeps = []
    init = transform._Keep.__init__
    monkeypatch.setattr(transform._Keep, "__init__",
                        lambda self, kept, modules=(): (keeps.append(kept),
                                                        init(self, kept, modules))[1])
    b, s = 2, 24
    ids = torch.randint(0, 96, (b, s))
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1)
    saved = {}
    for depth in (0, 2):
        keeps.clear()
        model = _model(num_nextn_predict_layers=depth)
        transform.apply_recompute(model, recompute)
        with SavedBytes(list(model.parameters())) as got:
            model(ids, labels=labels).sum()
        seen = set(got.storages) | {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved[depth] = got.total
        for t in torch.utils._pytree.tree_leaves([out for kept in keeps for _, out, _ in kept]):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                saved[depth] += t.untyped_storage().nbytes()
    cfg = ModelConfig(**SHAPE).resolved()
    work = Workload(seq_len=s, global_batch=b, precision="fp32", residual_bytes=4,
                    master_bytes=4)
    want = mtp_activation_bytes(cfg, Layout(microbatch_size=b, recompute=recompute), work)
    assert want > 0 and saved[2] - saved[0] == want


def test_pipeline_puts_the_modules_on_the_last_stage_with_a_copy_of_the_embedding():
    """Split over two stages, the modules join the last one (with the head), which embeds
    with its own copy of the embedding: placed as a replica of it (not saved, its values the
    embedding's, initialised by name alone); the planner's last-stage units are the
    runtime's (and so is the split)."""
    from threefold.accounting import stage_units
    from threefold.layout import Layout
    from threefold.parallel.pipeline.stage import embedding_replica, split_model
    from threefold.parallel.placement import placement
    from threefold.parallel.parallelize import zero_units

    model = _model(num_hidden_layers=4)
    model.init_weights(7)
    first, = split_model(model, p=2, pp_rank=0)
    last, = split_model(model, p=2, pp_rank=1)
    # balanced by parameters, the modules, the copy and the head counted on the last stage
    assert first.model.layers.layer_ids == [0, 1, 2] and last.model.layers.layer_ids == [3, 4, 5]
    assert embedding_replica(first) is None and first.model.mtp_embed is None
    copy = last.model.mtp_embed.weight
    assert embedding_replica(last) is copy and placement(copy).tied_replica
    assert placement(copy).source == "model.embed_tokens.weight"
    assert torch.equal(copy, model.model.embed_tokens.weight)
    with torch.device("meta"):
        from threefold.model.decoder import CausalLM
        alone, = split_model(CausalLM(model.cfg), p=2, pp_rank=1)
    alone.to_empty(device="cpu")
    alone.init_weights(7)
    assert torch.equal(alone.model.mtp_embed.weight, model.model.embed_tokens.weight)
    lay = Layout(pp=2)
    for stage, chunk in enumerate((first, last)):
        units = [tuple(q.numel() for q in u.parameters()) for u in zero_units(chunk, 1)[0]]
        assert tuple(units) == stage_units(model.cfg, lay, stage)
