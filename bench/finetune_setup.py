"""The inputs of ``bench_finetune``, made offline: a Hugging Face folder (a SmolLM2-135M-shaped
Llama with random weights from a seed, a byte-level BPE trained on Python's own sources, a
ChatML template) and the data: conversations for SFT, preference pairs for DPO.

The data is sized so that one global batch is the whole data set: the conversations pack
into exactly ``batch`` rows of ``seq_len`` tokens (threefold's best-fit decreasing, which is
TRL's ``bfd`` too), and there are ``batch`` pairs. Every step then sees every row, whatever
order each side's sampler draws them in, so the two sides' losses can be compared at every
step, not only the first.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; an assistant turn's content and its closing "<|im_end|>\n" sit inside
# {% generation %} marks, which is what TRL's assistant_only_loss needs, and the same span
# threefold trains (threefold/data/chat.py finds it without the marks).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def stdlib_text(max_chars: int = 3_000_000) -> str:
    """Python's standard library sources (sorted, so the same text every time), cut."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for p in sorted(root.glob("*.py")):
        t = p.read_text(errors="ignore")
        parts.append(t)
        n += len(t)
        if n >= max_chars:
            break
    return "".join(parts)[:max_chars]


def write_tokenizer(out: Path, text: str, vocab: int) -> None:
    """A byte-level BPE of ``vocab`` tokens trained on ``text``, with the ChatML special
    tokens, as tokenizer.json + tokenizer_config.json (eos ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text[i:i + 10000] for i in range(0, len(text), 10000)], trainer)
    tok.save(str(out / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": None, "model_max_length": 8192, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))


def write_model(out: Path, layers: int, seed: int) -> None:
    """The SmolLM2-135M shape with ``layers`` blocks, random weights drawn from ``seed``,
    saved as safetensors through transformers (the format a hub folder has)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**dict(SMOLLM2_135M, num_hidden_layers=layers), bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)


def words(text: str) -> list[str]:
    """The distinct identifiers of ``text``, sorted: the vocabulary conversations draw from."""
    import re

    return sorted(set(re.findall(r"[A-Za-z_]{3,12}", text)))


def sentence(rng: random.Random, vocab: list[str], n: int) -> str:
    """``n`` random words as a sentence."""
    return " ".join(rng.choice(vocab) for _ in range(n)).capitalize() + "."


def conversation(rng: random.Random, vocab: list[str], size: int) -> list[dict]:
    """A conversation of about ``size`` words: maybe a system turn, one or two exchanges."""
    msgs = [{"role": "system", "content": sentence(rng, vocab, 6)}] if rng.random() < .5 else []
    turns = rng.choice((1, 2))
    for _ in range(turns):
        msgs.append({"role": "user", "content": sentence(rng, vocab, max(2, size // 4 // turns))})
        msgs.append({"role": "assistant",
                     "content": sentence(rng, vocab, max(2, 3 * size // 4 // turns))})
    return msgs


class Lengths:
    """Token lengths as threefold's SFT computes them (its template code on this tokenizer)."""

    def __init__(self, hf_dir: Path):
        from tokenizers import Tokenizer

        from threefold.data.chat import load_chat_template

        self.tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        self.template = load_chat_template(hf_dir / "tokenizer.json", self.tok, "auto")

    def __call__(self, msgs: list[dict]) -> int:
        from threefold.data.chat import encode_conversation

        return len(encode_conversation(self.template, self.tok, msgs, "bench").ids)


def sft_data(hf_dir: Path, vocab: list[str], rows: int, seq_len: int, seed: int,
             fill: float = 0.93) -> list[list[dict]]:
    """Conversations that pack into exactly ``rows`` rows of ``seq_len`` tokens, filling about
    ``fill`` of them (none longer than ``seq_len``: neither side truncates)."""
    from threefold.post.sft import pack

    rng, length = random.Random(seed), Lengths(hf_dir)
    convs, lens = [], []
    while sum(lens) < fill * rows * seq_len:
        msgs = conversation(rng, vocab, rng.randint(seq_len // 32, seq_len // 6))
        n = length(msgs)
        if n > seq_len or len(pack(lens + [n], seq_len)) > rows:
            if sum(lens) > 0.8 * rows * seq_len:
                break
            continue
        convs.append(msgs)
        lens.append(n)
    assert len(pack(lens, seq_len)) == rows, "the conversations do not fill the rows"
    return convs


def dpo_data(vocab: list[str], pairs: int, seq_len: int, seed: int) -> list[dict]:
    """``pairs`` conversational preference pairs whose prompt + longer response stays well
    within ``seq_len`` tokens (under 3 tokens per word with this BPE, plus the template's:
    nothing is cut)."""
    rng = random.Random(seed + 1)
    budget = seq_len // 4  # words of prompt + longest response

    def reply(n: int) -> list[dict]:
        return [{"role": "assistant", "content": sentence(rng, vocab, n)}]

    out = []
    for _ in range(pairs):
        p = rng.randint(budget // 6, budget // 2)
        prompt = [{"role": "user", "content": sentence(rng, vocab, p)}]
        out.append({"prompt": prompt, "chosen": reply(rng.randint(2, budget - p)),
                    "rejected": reply(rng.randint(2, budget - p))})
    return out


def build(root: Path, layers: int, rows: int, seq_len: int, seed: int = 0,
          tokenizer_vocab: int = 8192) -> dict[str, Path]:
    """Write the HF folder ``root/hf``, ``root/sft.jsonl``, ``root/dpo.jsonl`` and one-record
    validation files (threefold validates at start and end; they keep that cheap)."""
    hf = root / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    text = stdlib_text()
    write_tokenizer(hf, text, tokenizer_vocab)
    write_model(hf, layers, seed)
    vocab = words(text)
    paths = {"hf": hf}
    for name, recs in (("sft", [{"messages": m}
                                for m in sft_data(hf, vocab, rows, seq_len, seed)]),
                       ("dpo", dpo_data(vocab, rows, seq_len, seed))):
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
        paths[name + "_val"] = root / f"{name}_val.jsonl"
        paths[name + "_val"].write_text(json.dumps(recs[0]) + "\n")
    return paths
