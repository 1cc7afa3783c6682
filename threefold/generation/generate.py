"""Generation from the policy with the training model's own code: a KV cache, greedy decoding
and sampling (temperature, top-k, top-p), batched left-padded prompts, stop on EOS.

``generate(model, prompt_ids, max_new_tokens, ...)`` runs ``threefold.model.decoder.CausalLM``
with a ``KVCache`` (one prefill of the padded prompts, then one token per step); there is no
second model implementation. Left padding: row b's first ``pad[b]`` slots are hidden from
every query and its real tokens take positions 0, 1, ... as if it were alone, so a prompt
gives the same tokens whatever it is batched with.

Reproducible sampling: each prompt draws from its own generator, seeded by ``seed`` and the
prompt's index (``prompt_indices``: its place in the whole list of prompts), one uniform number
per step, turned into a token by the inverse CDF of the filtered distribution. A completion
therefore depends only on (weights, prompt, seed, index), not on the batch, on padding or on
how many data-parallel ranks share the prompts (``dp_share``).

Tensor parallelism: the patched modules compute the same hidden states on every tp rank; the
vocab-parallel head's logits are all-gathered, every tp rank samples with the same generators,
and rank 0's tokens are broadcast so the ranks can never drift apart. Sequence parallelism is
refused (a decoding step is one token, not divisible over ranks); ZeRO-3 shards are not gathered
here (generate from whole weights).

``threefold generate --from RUN_DIR --prompt "..."`` loads a run's newest checkpoint (or a
Hugging Face folder; a LoRA run's base with its adapters) and its tokenizer, prints the
completions and the tokens/s; with ``--chat`` each prompt is a user message rendered by the
chat template SFT uses, and the reply stops at the template's end-of-turn token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from threefold.weights.checkpoint_verify import CheckpointError
from threefold.data import DataError
from threefold.data import eot_id, load_tokenizer
from threefold.comm.distributed import pick_device
from threefold.weights import find_checkpoint
from threefold.weights.hf import load_pretrained
from threefold.weights.hub import locate
from threefold.model.decoder import CausalLM
from threefold.model.kvcache import KVCache
from threefold.parallel.transforms.tensor import gather_full
from threefold.generation.peft_export import load_lora_model, lora_checkpoint
from threefold.data.chat import BuiltinTemplate, encode_text, end_of_turn, load_chat_template

_SEED_STRIDE = 1_000_003  # (seed, prompt index) -> one generator seed, as init_weights mixes


@dataclass
class GenerationResult:
    """What ``generate`` returns, one entry per prompt (in the order given).

    ``sequences[i]`` is prompt i followed by its completion; the completion starts at
    ``prompt_lengths[i]`` and has ``lengths[i]`` tokens (``tokens[i]``, the EOS included when
    ``finished[i]``). ``prompt_indices`` are the indices that seeded each prompt's generator.
    ``tokens_per_s`` counts generated tokens over the whole call (prefill included)."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    lengths: list[int]
    finished: list[bool]
    prompt_indices: list[int]
    sequences: list[list[int]] = field(repr=False)
    seconds: float
    prefill_seconds: float
    tokens_per_s: float


def dp_share(n_prompts: int, rank: int, size: int) -> list[int]:
    """Indices of the prompts data-parallel rank ``rank`` of ``size`` generates: a contiguous
    block, the blocks differing by at most one prompt. Pass them as ``prompt_indices``."""
    return list(range(n_prompts * rank // size, n_prompts * (rank + 1) // size))


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """(B, V) logits -> fp32 logits divided by ``temperature`` with -inf outside the ``top_k``
    largest (0 = all; ties at the k-th value kept) and outside the nucleus: the smallest set of
    most likely tokens whose probability reaches ``top_p`` (Holtzman et al., arXiv 1904.09751;
    the most likely token always stays). Filters apply in that order, as transformers' do."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float,
           top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """One token per row of (B, V) logits: argmax when ``temperature`` is 0, else a draw from
    the filtered softmax by inverse CDF with one uniform number from row b's generator."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, device=g.device) for g in generators])
    u = u.to(cdf.device)[:, None] * cdf[:, -1:]
    # right=True: the first token whose cdf exceeds u, so a zero-probability token (cdf equal
    # to its predecessor's) is never chosen
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.shape[-1] - 1)


def _tp(model, comm) -> int:
    """The model's tensor-parallel degree, checked against ``comm``."""
    t = model.tp_size
    if t > 1:
        if comm is None:
            raise ValueError("generate: a tensor-parallel model needs its comm (the 'tp' axis)")
        if model.sequence_parallel:
            raise ValueError("generate: sequence parallelism is not supported (decoding steps "
                             "are one token); apply tensor parallelism without it")
    return t


def _last_logits(model: CausalLM, ids: torch.Tensor, cache: KVCache, comm,
                 tp: int) -> torch.Tensor:
    """fp32 logits (B, V) of the last position of ``ids`` after it is added to ``cache``."""
    h = model.forward_hidden(ids, cache=cache)[:, -1:]
    logits = model.lm_head(h)[:, 0].float()
    if tp > 1:  # vocab-parallel head: gather the shards, drop the padding
        logits = gather_full(logits, 1, model.cfg.vocab_size, comm)
    return logits


def _check_request(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float, top_p: float, top_k: int,
                   prompt_indices: Sequence[int] | None) -> list[int]:
    """ValueError for arguments ``generate`` cannot honour; the prompts' seed indices."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError("generate: need max_new_tokens >= 0, temperature >= 0, "
                         "0 < top_p <= 1, top_k >= 0")
    n = len(prompt_ids)
    indices = list(range(n)) if prompt_indices is None else [int(i) for i in prompt_indices]
    if len(indices) != n:
        raise ValueError("generate: prompt_indices needs one index per prompt")
    return indices


def _left_padded(prompt_ids: Sequence[Sequence[int]], pad_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (n, width) with each prompt at the right end, padding slots per row)."""
    width = max(len(p) for p in prompt_ids)
    pad = torch.tensor([width - len(p) for p in prompt_ids], device=device)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
    return ids, pad


def _generators(seed: int, indices: list[int], device: torch.device) -> list[torch.Generator]:
    """One generator per prompt, seeded by (``seed``, its index)."""
    gen_device = device if device.type != "mps" else torch.device("cpu")
    return [torch.Generator(device=gen_device).manual_seed(seed * _SEED_STRIDE + i)
            for i in indices]


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (so that the clock measures it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Decoding:
    """One batch's decoding: the model, its tp layout, the left padding and the cache."""

    model: CausalLM
    comm: object
    tp: int
    pad: torch.Tensor  # padding slots per row
    total: int  # prompt width + new tokens: the cache's length
    use_cache: bool
    cache: KVCache | None = None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits after the padded prompts, which fill a fresh cache."""
        self.cache = KVCache(ids.shape[0], self.total, self.pad, ids.device)
        return _last_logits(self.model, ids, self.cache, self.comm, self.tp)

    def step(self, tok: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Logits after ``tok`` (B,): one cached position, or without the cache the whole
        sequence ``seq`` (already ending with ``tok``) recomputed in a fresh cache."""
        if self.use_cache:
            return _last_logits(self.model, tok[:, None], self.cache, self.comm, self.tp)
        fresh = KVCache(seq.shape[0], self.total, self.pad, seq.device)
        return _last_logits(self.model, seq, fresh, self.comm, self.tp)

    def decode(self, ids: torch.Tensor, logits: torch.Tensor, max_new_tokens: int,
               eos: torch.Tensor, pad_id: int, gens: list, temperature: float, top_k: int,
               top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, max_new_tokens) tokens after the prompts ``ids`` (``pad_id`` once a row has
        ended at an ``eos`` id) and how many each row made; stops when every row has ended."""
        n, device = ids.shape[0], ids.device
        seq = ids
        out = torch.zeros((n, max_new_tokens), dtype=torch.long, device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        counts = torch.zeros(n, dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            tok = sample(logits, gens, temperature, top_k, top_p)
            if self.tp > 1:  # every tp rank feeds the same token (they sampled the same)
                self.comm.broadcast(tok, 0, "tp")
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            out[:, step] = tok
            counts += (~done).long()
            done |= torch.isin(tok, eos)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if not self.use_cache:
                seq = torch.cat([seq, tok[:, None]], dim=1)
            logits = self.step(tok, seq)
        return out, counts


def _result(prompt_ids: Sequence[Sequence[int]], out: torch.Tensor, counts: torch.Tensor,
            eos: torch.Tensor, indices: list[int], seconds: float,
            prefill_s: float) -> GenerationResult:
    """The ``GenerationResult`` of decoded tokens ``out`` with ``counts`` per row."""
    lengths = counts.tolist()
    rows = out.tolist()
    eos_set = set(eos.tolist())
    tokens = [rows[b][:lengths[b]] for b in range(len(rows))]
    finished = [bool(t) and t[-1] in eos_set for t in tokens]
    made = sum(lengths)
    return GenerationResult(
        tokens=tokens, prompt_lengths=[len(p) for p in prompt_ids], lengths=lengths,
        finished=finished, prompt_indices=indices,
        sequences=[list(p) + t for p, t in zip(prompt_ids, tokens)],
        seconds=seconds, prefill_seconds=prefill_s,
        tokens_per_s=made / seconds if seconds > 0 else float("inf"))


# inference mode, not no_grad: nothing here is differentiated, and without autograd's version
# counters and view tracking a step's many small ops cost less (bench/bench_generate.py)
@torch.inference_mode()
def generate(model: CausalLM, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             eos_id: int | Sequence[int] | None = None, seed: int = 0,
             prompt_indices: Sequence[int] | None = None, comm=None, use_cache: bool = True,
             pad_id: int = 0) -> GenerationResult:
    """Complete every prompt (a list of token ids, at least one each) by up to
    ``max_new_tokens`` tokens, stopping a row at ``eos_id`` (one id or several).

    ``temperature`` 0 is greedy decoding; otherwise tokens are drawn from the softmax of
    logits / temperature, restricted to the ``top_k`` most likely (0 = no limit) and to the
    ``top_p`` nucleus. Prompt i's draws come from a generator seeded by (``seed``,
    ``prompt_indices[i]``; default i). ``comm``: the model's communication layer when it is
    tensor parallel (its "tp" axis). ``use_cache=False`` recomputes the whole sequence every
    step (for measuring the cache; same tokens). ``pad_id`` fills the padding slots (any valid
    id: nothing attends to them)."""
    indices = _check_request(prompt_ids, max_new_tokens, temperature, top_p, top_k,
                             prompt_indices)
    tp = _tp(model, comm)
    device = next(model.parameters()).device
    eos = torch.tensor([] if eos_id is None else
                       [eos_id] if isinstance(eos_id, int) else list(eos_id),
                       dtype=torch.long, device=device)
    ids, pad = _left_padded(prompt_ids, pad_id, device)
    gens = _generators(seed, indices, device) if temperature > 0 else []
    dec = _Decoding(model, comm, tp, pad, ids.shape[1] + max_new_tokens, use_cache)
    was_training = model.training
    model.eval()
    _synchronize(device)
    t0 = time.perf_counter()
    logits = dec.prefill(ids)
    prefill_s = time.perf_counter() - t0
    out, counts = dec.decode(ids, logits, max_new_tokens, eos, pad_id, gens, temperature,
                             top_k, top_p)
    _synchronize(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    return _result(prompt_ids, out, counts, eos, indices, seconds, prefill_s)


# --------------------------------------------------------------------------------------------
# threefold generate
# --------------------------------------------------------------------------------------------
def load_for_generation(path, device: str = "cpu"):
    """(model in eval mode, tokenizer or None, its tokenizer path) from a threefold run
    directory or checkpoint (its newest checkpoint) or a Hugging Face folder. A LoRA run's
    model is its base with the adapters on (``threefold.generation.peft_export.load_lora_model``)."""
    path = Path(path)
    if lora_checkpoint(path) is not None:
        model = load_lora_model(path)
    else:
        cfg, weights = load_pretrained(path)
        model = CausalLM(cfg)
        model.load_state_dict(weights, strict=True)
    model.to(device).eval()
    places = [path]
    if not (path / "tokenizer.json").is_file():
        try:
            ckpt = find_checkpoint(path)
            places += [ckpt, ckpt.parent.parent]
        except Exception:
            pass
    tok_path = next((p / "tokenizer.json" for p in places if (p / "tokenizer.json").is_file()),
                    None)
    return model, (load_tokenizer(tok_path) if tok_path else None), tok_path


def config_stop_ids(*folders: Path) -> list[int]:
    """The stop tokens a Hugging Face folder names: ``eos_token_id`` (an int or a list) of its
    generation_config.json, else of its config.json (transformers' fallback)."""
    for f in (d / n for d in folders for n in ("generation_config.json", "config.json")):
        try:
            eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id") \
                if f.is_file() else None
        except (ValueError, AttributeError):
            raise DataError(f"{f}: not a JSON object") from None
        if eos is not None:
            return [i for i in ([eos] if isinstance(eos, int) else eos) if isinstance(i, int)]
    return []


def chat_prompts(tok, tok_path: Path, texts: Sequence[str], system: str | None = None
                 ) -> tuple[list[list[int]], list[int]]:
    """Each text as a user message (after ``system``'s, if given) rendered with the generation
    prompt by the template SFT uses (``load_chat_template``: the tokenizer folder's, a run's
    saved one, else the built-in) and tokenized as SFT tokenizes (special-token text becomes
    special tokens, nothing added); and the template's end-of-turn token(s) to stop at."""
    eot = eot_id(tok, missing_ok=True)
    try:
        template = load_chat_template(tok_path, tok)
    except DataError as e:
        if eot is None:  # no template of the folder's own, and none for the built-in one
            raise DataError(f"--chat: {tok_path.parent} has no chat template (tokenizer_config"
                            ".json or chat_template.jinja) and its tokenizer no end-of-text "
                            "token for the built-in one") from None
        raise DataError(f"--chat: {e}") from None
    head = [{"role": "system", "content": system}] if system is not None else []
    prompts = [encode_text(tok, template.render(head + [{"role": "user", "content": t}],
                                                add_generation_prompt=True)).ids
               for t in texts]
    stops = [end_of_turn(template, tok)]
    if isinstance(template, BuiltinTemplate):
        stops.append(eot)
    return prompts, stops


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="threefold generate",
        description="Complete prompts with a trained run's model (KV cache) and report tokens/s.")
    p.add_argument("--from", dest="source", default="runs/default",
                   help="run, checkpoint, HF folder or hub id org/name[@rev] (runs/default)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch (left-padded); default: 'def '")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered with the model's chat template "
                        "(as SFT renders); prints the assistant's reply, stops at end of turn")
    p.add_argument("--system", default=None, help="--chat: a system message before each prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos", action="store_true", help="do not stop at end-of-text")
    p.add_argument("--no-cache", action="store_true", help="recompute the sequence each step")
    p.add_argument("--compare-no-cache", action="store_true", help="also time it uncached")
    p.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0 = torch's default)")
    p.add_argument("--json", action="store_true", help="print one JSON line as well")
    return p


def _prepare(args, path: Path):
    """(model, tokenizer, prompt ids, stop ids, device) for the command line; DataError,
    CheckpointError, ValueError or OSError for what cannot run."""
    if min(args.max_new_tokens, args.temperature, args.top_k) < 0 or not 0 < args.top_p <= 1:
        raise ValueError("need --max-new-tokens >= 0, --temperature >= 0, "
                         "0 < --top-p <= 1, --top-k >= 0")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    device = pick_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tok, tok_path = load_for_generation(path, device)
    if tok is None:
        raise DataError(f"{path}: no tokenizer.json in the run or checkpoint")
    texts = args.prompt or ["def "]
    if args.chat:
        prompts, stops = chat_prompts(tok, tok_path, texts, args.system)
    else:
        prompts, stops = [tok.encode(t).ids for t in texts], [eot_id(tok, missing_ok=True)]
    if any(not p for p in prompts):
        raise ValueError("--prompt: a prompt encodes to no tokens")
    # a Hugging Face folder names its stop tokens (an instruct model's end of turn among them)
    stops += config_stop_ids(*([path] if path.is_dir() else []), tok_path.parent)
    return model, tok, prompts, sorted({i for i in stops if i is not None}), device


def main(argv: list[str]) -> int:
    """`threefold generate --from RUN_DIR --prompt TEXT [...]`; returns the exit code."""
    args = _parser().parse_args(argv)
    try:  # --from: a path, or a hub id fetched into the local cache (threefold.weights.hub)
        model, tok, prompts, stops, device = _prepare(args, locate(args.source, "--from").path)
    except (CheckpointError, DataError, ValueError, OSError) as e:
        print(f"threefold: error: {e}", file=sys.stderr)
        return 2
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_p=args.top_p, top_k=args.top_k, eos_id=None if args.no_eos else stops,
              seed=args.seed)
    runs = [not args.no_cache] + ([False] if args.compare_no_cache and not args.no_cache
                                  else [])
    # warm-up: the first forward pays for one-off allocations and kernel selection
    generate(model, prompts, **{**kw, "max_new_tokens": min(2, args.max_new_tokens)})
    results = {}
    for use_cache in runs:
        results[use_cache] = generate(model, prompts, use_cache=use_cache, **kw)
    res = results[runs[0]]
    for text, toks, done in zip(args.prompt or ["def "], res.tokens, res.finished):
        if not args.chat:
            print(f"--- {text!r}\n{text}{tok.decode(toks)}")
            continue  # --chat: the reply alone, without its stop token
        if len(prompts) > 1:
            print(f"--- {text!r}")
        print(tok.decode(toks[:-1] if done else toks))
    for use_cache, r in results.items():  # with --chat on stderr: stdout holds the replies
        print(f"generated {sum(r.lengths)} tokens for {len(prompts)} prompt(s) in "
              f"{r.seconds:.3f} s (prefill {r.prefill_seconds * 1e3:.1f} ms): "
              f"{r.tokens_per_s:.1f} tokens/s ({'KV cache' if use_cache else 'no cache'}, "
              f"{device.type})", file=sys.stderr if args.chat else sys.stdout)
    if len(results) == 2 and results[True].tokens != results[False].tokens:
        print("warning: the cached and uncached runs gave different tokens", file=sys.stderr)
    if args.json:
        print(json.dumps({"tokens_per_s": {("cache" if c else "no_cache"): r.tokens_per_s
                                           for c, r in results.items()},
                          "lengths": res.lengths, "tokens": res.tokens,
                          "prompt_ids": prompts, "stop_ids": stops}))
    return 0
