"""Generation (threefold.generation.generate) with the training model's code and a KV cache: greedy
tokens equal transformers' ``generate`` on the same weights (Llama with GQA, Mixtral), batched
left-padded prompts give each prompt's single-prompt tokens, the cache gives the uncached
tokens and logits, sampling is reproducible per prompt, EOS stops a row, and DP2 / TP2 give
the single-process tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tokenizers import Tokenizer

from tests.conftest import tiny_overrides
from tests.dist import run_checks
from tests.test_model import hf_model, perturb_norms, tiny
from threefold.generation.generate import dp_share, filter_logits, generate
from threefold.model.decoder import CausalLM
from threefold.model.kvcache import KVCache

VOCAB = 300
NEW = 10
LENGTHS = (5, 11, 1, 8)  # different lengths: rows 0, 2, 3 are left-padded
SAMPLING = dict(temperature=1.0, top_p=0.9, top_k=40, seed=7)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: one-token decoding steps of a tiny model are dominated by per-op
    overhead, which extra threads on a shared 2-core machine only make worse."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(cfg, seed: int = 3) -> CausalLM:
    """Our model with a large init (peaked attention: position or mask errors change tokens)
    and non-trivial norm weights."""
    model = CausalLM(dataclasses.replace(cfg, init_std=0.1)).eval()
    model.init_weights(seed=seed)
    perturb_norms(model)
    return model


def _moe_cfg(**kw):
    return tiny(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **kw)


def _prompts(vocab: int = VOCAB, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def _mixtral(cfg):
    from tests.test_moe import mixtral

    return mixtral(cfg)


@pytest.mark.parametrize("case", ["llama-gqa", "llama-kv1-tied", "mixtral"])
def test_greedy_equals_transformers_generate(case):
    cfg, make = {"llama-gqa": (tiny(rope_theta=10000.0), hf_model),
                 "llama-kv1-tied": (tiny(num_key_value_heads=1, tie_word_embeddings=True),
                                    hf_model),
                 "mixtral": (_moe_cfg(), _mixtral)}[case]
    ours = _model(cfg)
    ref = make(ours.cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)
    got = generate(ours, prompts, NEW)
    assert got.tokens == out[:, ids.shape[1]:].tolist()
    assert got.lengths == [NEW] * len(prompts) and got.prompt_lengths == list(LENGTHS)
    assert got.sequences[1] == prompts[1] + got.tokens[1] and got.tokens_per_s > 0


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_padded_batch_equals_single_prompts_and_cache_equals_recompute(moe):
    model = _model(_moe_cfg() if moe else tiny())
    prompts = _prompts()
    for kw in ({}, SAMPLING):
        batch = generate(model, prompts, NEW, **kw)
        single = [generate(model, [p], NEW, prompt_indices=[i], **kw).tokens[0]
                  for i, p in enumerate(prompts)]
        assert batch.tokens == single, kw
        assert generate(model, prompts, NEW, use_cache=False, **kw).tokens == batch.tokens, kw


def test_cached_logits_equal_the_training_forward():
    model = _model(tiny())
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(2, 12)
        parts = [model(ids[:, :7], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                    for t in range(7, 12)]
    assert cache.length == 12
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5
    # a left-padded row: its real tokens' logits are those of the row alone
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1, :9]], dim=1)
    with torch.no_grad():
        got = model(padded, cache=KVCache(1, 12, pad=torch.tensor([3])))[:, 3:]
    assert (got - full[:1, :9]).abs().max().item() <= 1e-5


def test_sampling_filters_seeds_and_eos():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    p = logits.softmax(-1)[0]
    nucleus = filter_logits(logits, top_p=float(p[0] + p[1]) - 1e-4)  # needs 2 tokens
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, top_p=1e-6)).sum() == 1  # the top one stays

    model = _model(tiny())
    prompts = _prompts()
    greedy = generate(model, prompts, NEW)
    assert generate(model, prompts, NEW, temperature=1.0, top_k=1).tokens == greedy.tokens
    assert generate(model, prompts, NEW, temperature=1.0, top_p=1e-6).tokens == greedy.tokens
    a, b = generate(model, prompts, NEW, **SAMPLING), generate(model, prompts, NEW, **SAMPLING)
    assert a.tokens == b.tokens
    assert generate(model, prompts, NEW, **{**SAMPLING, "seed": 8}).tokens != a.tokens
    # EOS: the token greedy emits third in row 1 stops that row there, EOS included
    eos = greedy.tokens[1][2]
    stopped = generate(model, prompts, NEW, eos_id=eos)
    assert stopped.tokens[1] == greedy.tokens[1][:greedy.tokens[1].index(eos) + 1]
    assert stopped.finished[1] and stopped.lengths[1] == len(stopped.tokens[1])
    for row, full in zip(stopped.tokens, greedy.tokens):
        assert row == (full[:full.index(eos) + 1] if eos in full else full)
    assert dp_share(5, 0, 2) == [0, 1] and dp_share(5, 1, 2) == [2, 3, 4]


def test_cli_generates_from_a_training_run(corpus, cache_dir, tmp_path, capsys):
    from threefold.commands.main import main
    from threefold.config import load_config
    from threefold.training.train import train

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(corpus, cache_dir, run, train__steps=2)))
    capsys.readouterr()
    argv = ["generate", "--from", str(run), "--prompt", "def ", "--prompt", "import os",
            "--max-new-tokens", "6", "--no-eos", "--compare-no-cache", "--json", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert report["lengths"] == [6, 6] and set(report["tokens_per_s"]) == {"cache", "no_cache"}
    assert sum("tokens/s (KV cache" in line for line in out) == 1
    assert main(["generate", "--from", str(tmp_path / "missing")]) == 2
    # --chat on a run that saved the built-in template (as SFT does): rendered by it, stopping
    # at the end-of-text token it closes turns with
    from threefold.data.chat import BUILTIN_TEMPLATE

    (run / "chat_template.jinja").write_text(BUILTIN_TEMPLATE)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    assert main(["generate", "--from", str(run), "--chat", "--system", "Be brief.", "--prompt",
                 "hi", "--max-new-tokens", "3", "--json", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    eot = tok.token_to_id("<|endoftext|>")
    assert report["stop_ids"] == [eot]
    want = "<|system|>\nBe brief.<|endoftext|><|user|>\nhi<|endoftext|><|assistant|>\n"
    assert report["prompt_ids"] == [tok.encode(want, add_special_tokens=False).ids]
    assert report["prompt_ids"][0].count(eot) == 2  # special-token text -> the special token
    assert main(["generate", "--from", str(run), "--system", "x"]) == 2  # --system needs --chat


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _chatml_folder(folder, template: bool = True,
                   specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A Hugging Face folder: a tiny Llama (untied head) and a byte-level BPE with
    ``specials`` whose tokenizer_config.json carries the ChatML template when ``template``.
    Returns (our model, tokenizer); the weights are written by ``_save_hf``."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, how are you? I am a helpful assistant."] * 20,
                            trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**conf, "chat_template": CHATML} if template else conf))
    ours = _model(tiny(vocab_size=tok.get_vocab_size()))
    return ours, tok


def _save_hf(ours, folder) -> None:
    ref = hf_model(ours.cfg)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ref.save_pretrained(folder, safe_serialization=True)


def test_chat_renders_like_transformers_and_stops_at_im_end(tmp_path, capsys):
    from threefold.generation.generate import main

    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    ours, tok = _chatml_folder(folder)
    im_end = tok.token_to_id("<|im_end|>")
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello you"}]
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = list(getattr(want, "input_ids", want))
    # greedy without stopping, then the head rows of <|im_end|> and of the third new token
    # (new so far) swapped: the same first tokens, then <|im_end|> wins at that step
    free = generate(ours, [want], 8).tokens[0]
    step = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] + [im_end])
    assert im_end not in free[:step]
    with torch.no_grad():
        w = ours.lm_head.weight
        w[[im_end, free[step]]] = w[[free[step], im_end]]
    _save_hf(ours, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, im_end]}))
    capsys.readouterr()
    argv = ["--from", str(folder), "--chat", "--system", "be nice", "--prompt", "hello you",
            "--max-new-tokens", "8", "--json", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert report["prompt_ids"] == [want]
    assert report["stop_ids"] == [0, im_end]  # the template's, and generation_config.json's
    assert report["tokens"] == [free[:step] + [im_end]]
    assert out[:-1] == tok.decode(free[:step]).splitlines()  # the reply alone


def test_chat_without_template_or_end_of_text_is_refused(tmp_path, capsys):
    from threefold.generation.generate import main

    folder = tmp_path / "hf"
    # no template and none of the end-of-text names (<|im_end|> would be one)
    ours, _ = _chatml_folder(folder, template=False, specials=["<|im_start|>"])
    _save_hf(ours, folder)
    capsys.readouterr()
    assert main(["--from", str(folder), "--chat", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threefold: error: --chat:") and "no chat" in err[0]


# --------------------------------------------------------------------------------------------
# DP2 and TP2: each rank builds the same model and compares with its own one-process result
# --------------------------------------------------------------------------------------------
def _dp_check(rank: int, world: int, kw: dict) -> dict:
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh

    dims = Layout(dp_shard=world, tp=1)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    model = _model(tiny())
    prompts = _prompts(lengths=(5, 11, 1, 8, 3))
    whole = generate(model, prompts, NEW, **kw).tokens
    mine = dp_share(len(prompts), comm.rank("dp"), comm.size("dp"))
    local = generate(model, [prompts[i] for i in mine], NEW, prompt_indices=mine, **kw)
    gathered = comm.all_gather_object(list(zip(local.prompt_indices, local.tokens)), "dp")
    got = dict(pair for part in gathered for pair in part)
    return {"equal": [got[i] for i in range(len(prompts))] == whole, "share": mine}


def _tp_check(rank: int, world: int, cfg_kw: dict, kw: dict) -> dict:
    from threefold.comm.counted import Comm
    from threefold.layout import Layout
    from threefold.comm.mesh import build_mesh
    from threefold.parallel.transforms.tensor import apply_tensor_parallel

    dims = Layout(tp=world)
    comm = Comm(dims, build_mesh(dims, "cpu"))
    cfg_kw = dict(cfg_kw)
    cfg = _moe_cfg(**cfg_kw) if cfg_kw.pop("moe", False) else tiny(**cfg_kw)
    prompts = _prompts(vocab=cfg.vocab_size)
    whole = generate(_model(cfg), prompts, NEW, **kw).tokens
    model = apply_tensor_parallel(_model(cfg), comm)
    got = generate(model, prompts, NEW, comm=comm, **kw).tokens
    return {"equal": got == whole, "tokens": got, "tp_bytes": comm.totals().get("tp", {})}


def test_dp2_and_tp2_equal_one_process():
    checks = [(_dp_check, ({},)), (_dp_check, (SAMPLING,)),
              # vocabulary 301: the vocab-parallel head pads one row, dropped by the gather
              (_tp_check, ({"vocab_size": 301}, {})), (_tp_check, ({"vocab_size": 301}, SAMPLING)),
              (_tp_check, ({"num_key_value_heads": 1}, {})),  # k/v replicated over tp
              (_tp_check, ({"moe": True}, SAMPLING))]
    results = run_checks(2, checks, timeout=120)
    for (fn, args), per_rank in zip(checks, results):
        assert all(r["equal"] for r in per_rank), (fn.__name__, args)
    assert [r["share"] for r in results[0]] == [[0, 1], [2, 3, 4]]
    for per_rank in results[2:]:
        assert per_rank[0]["tokens"] == per_rank[1]["tokens"]
        assert per_rank[0]["tp_bytes"]  # the tp ranks did communicate
