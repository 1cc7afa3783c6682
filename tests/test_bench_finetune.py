"""bench_finetune's inputs: the folder it writes is the same model to transformers and to
threefold, and the conversations it writes are masked alike by both (threefold's span rule
against transformers' ``{% generation %}`` assistant mask, which TRL's assistant-only loss
uses) and pack into exactly the rows asked for (so every step sees the whole data set)."""

from __future__ import annotations

import pytest
import torch

from bench.finetune_setup import (Lengths, sft_data, stdlib_text, words, write_model,
                                  write_tokenizer)


def test_folder_and_conversations_agree_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from threefold.weights.hf import import_hf, init_from_hf
    from threefold.model.decoder import CausalLM
    from threefold.data.chat import encode_conversation
    from threefold.post.sft import pack

    hf = tmp_path / "hf"
    hf.mkdir()
    text = stdlib_text(200_000)
    write_tokenizer(hf, text, 512)
    write_model(hf, 1, seed=0)
    cfg, _, tok_path = import_hf(hf)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.head_dim, cfg.num_key_value_heads,
            cfg.tie_word_embeddings, cfg.rope_theta) == (1, 49152, 64, 3, True, 1e5)
    assert tok_path == hf / "tokenizer.json"
    ours = CausalLM(cfg).eval()
    init_from_hf(ours, hf)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5

    seq_len, rows = 128, 2
    convs = sft_data(hf, words(text), rows, seq_len, seed=0)
    lengths = Lengths(hf)
    assert len(pack([lengths(m) for m in convs], seq_len)) == rows and len(convs) > rows
    htok = transformers.AutoTokenizer.from_pretrained(hf)
    assert htok.eos_token == "<|im_end|>"
    for m in convs:
        enc = encode_conversation(lengths.template, lengths.tok, m, "bench")
        got = htok.apply_chat_template(m, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert list(got["input_ids"]) == list(enc.ids)
        assert list(got["assistant_masks"]) == [int(t) for t in enc.trained]
        assert any(enc.trained) and not all(enc.trained)
