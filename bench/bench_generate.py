"""Tokens/s of `threefold generate` (``threefold.generation.generate.generate``, its KV cache) against
transformers' ``generate`` with its KV cache, on the same Hugging Face folder, the same prompts
and greedy decoding; the generated token ids must be identical.

    python3 bench/bench_generate.py [--layers 30] [--new-tokens 64] [--batches 1,4]
                                    [--rounds 3] [--threads 1]
    python3 bench/bench_generate.py --quick      # 6 layers, 32 new tokens: ~1 min

Goal (GRPO's rollouts run on it): ratio threefold / transformers >= 1.0.

The model is SmolLM2-135M's shape (vocabulary 49,152, hidden 576, 30 layers, 9 query and 3
key/value heads, tied embeddings), written once by transformers with random weights from a
seed (``save_pretrained``, safetensors). The init's standard deviation is 0.05, not Llama's
0.02: at 0.02 a random model's greedy output repeats one or two tokens, so "the same tokens"
would say little; at 0.05 every new token differs from the last.

Each side runs in its own process (``--worker``), started alternately, round after round, the
order flipped every round, with the same torch thread count (``--threads``, also
OMP_NUM_THREADS): a process holds only its own side's allocations and thread pool, and noise
from the shared machine falls on both sides. A worker loads the folder (threefold:
``load_for_generation`` as `threefold generate` does; transformers: ``AutoModelForCausalLM``,
fp32, eval), warms up with a short generation per batch, then times ``--reps`` generations per
batch size and keeps the fastest (the least disturbed by other work on the machine; both sides
alike): prefill and ``--new-tokens`` decoding steps, no end-of-sequence token on either side
(every row makes all its tokens). ``--one-process`` instead loads both models into one
process per round and alternates them generation by generation (the order flipped every
rep): fair too, since each side's weights (0.5 GB, far beyond any cache) stream from memory
at every step whichever side ran before, and it follows load that changes within seconds,
which separate processes (started seconds apart) cannot. A batch holds prompts of different lengths,
left-padded (threefold's padding, transformers' attention mask), as GRPO's rollouts are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import report, revision  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000,
             rms_norm_eps=1e-5, max_position_embeddings=2048)
INIT_STD = 0.05
SIDES = ("threefold", "transformers")


def make_folder(folder: Path, layers: int, seed: int) -> None:
    """Write the SmolLM2-135M-shaped model with ``layers`` layers and random weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # no bos/eos/pad ids: transformers then stops at no token, as threefold (eos_id=None)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, initializer_range=INIT_STD,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                   **SHAPE)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of random ids: the first ``length`` long, the others shorter."""
    import torch

    g = torch.Generator().manual_seed(seed + batch)
    lengths = [max(1, length - 5 * b) for b in range(batch)]
    return [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def _threefold_side(folder: Path):
    """A function (prompts, new tokens) -> generated ids, on threefold's model."""
    from threefold.generation.generate import generate, load_for_generation

    model, _, _ = load_for_generation(folder)
    return lambda ps, n: generate(model, ps, n).tokens


def _transformers_side(folder: Path):
    """The same with transformers' model and ``generate`` (KV cache, greedy, left padding)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()

    def run(ps: list[list[int]], n: int) -> list[list[int]]:
        width = max(map(len, ps))
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(ps):
            ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        return out[:, width:].tolist()
    return run


def worker(args: argparse.Namespace) -> None:
    """The sides ``args.worker`` names ("both": the two, in this one process) : warm up, time
    ``reps`` generations per batch size and side (with both, alternating, the order flipped
    every rep), keep the fastest (their tokens must agree) and print JSON."""
    import torch

    torch.set_num_threads(args.threads)
    sides = SIDES if args.worker == "both" else (args.worker,)
    runs = {side: (_threefold_side if side == "threefold" else _transformers_side)(args.folder)
            for side in sides}
    out = {side: {} for side in sides}
    for batch in args.batches:
        ps = prompts(batch, args.prompt_len, args.seed)
        times, toks = {side: [] for side in sides}, {}
        for side in sides:
            runs[side](ps, 2)  # warm-up: one-off allocations, kernel selection
        for rep in range(args.reps):
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                t0 = time.perf_counter()
                got = runs[side](ps, args.new_tokens)
                times[side].append(time.perf_counter() - t0)
                if toks.setdefault(side, got) != got:
                    raise SystemExit(f"bench_generate: {side} is not deterministic")
        for side in sides:
            out[side][batch] = {"seconds": min(times[side]), "tokens": toks[side]}
    print(json.dumps(out))


def run_worker(side: str, folder: Path, args: argparse.Namespace) -> dict[int, dict]:
    """Start one worker process for ``side`` (or "both"); its result per side and batch."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--folder",
           str(folder), "--batches", ",".join(map(str, args.batches)), "--new-tokens",
           str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--threads",
           str(args.threads), "--seed", str(args.seed), "--reps", str(args.reps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_generate: the {side} worker failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {s: {int(b): v for b, v in per.items()} for s, per in got.items()}


def compare(args: argparse.Namespace, folder: Path) -> tuple[list[dict], dict]:
    """Alternate the sides for ``args.rounds`` rounds; (one row per round and batch size,
    {batch size: whether every round's tokens were identical on both sides})."""
    rows, same = [], {b: True for b in args.batches}
    for r in range(args.rounds):
        if args.one_process:
            got = run_worker("both", folder, args)
        else:
            got = {side: run_worker(side, folder, args)[side]
                   for side in (SIDES if r % 2 == 0 else SIDES[::-1])}
        for b in args.batches:
            ours, ref = got["threefold"][b], got["transformers"][b]
            same[b] &= ours["tokens"] == ref["tokens"]
            made = b * args.new_tokens
            rows.append({"round": r, "batch": b, "threefold_tok_s": made / ours["seconds"],
                         "transformers_tok_s": made / ref["seconds"],
                         "ratio": ref["seconds"] / ours["seconds"],
                         "same_tokens": ours["tokens"] == ref["tokens"],
                         "distinct": len({t for row in ours["tokens"] for t in row})})
    return rows, same


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="30 (SmolLM2-135M); --quick: 6")
    ap.add_argument("--new-tokens", type=int, default=None, help="64; --quick: 32")
    ap.add_argument("--prompt-len", type=int, default=32, help="the longest prompt's tokens")
    ap.add_argument("--batches", default="1,4", help="batch sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=None, help="3; --quick: 2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="6 layers, 32 new tokens, 2 rounds")
    ap.add_argument("--folder", type=Path, default=None,
                    help="a model folder to use (default: one written in a temporary directory)")
    ap.add_argument("--one-process", action="store_true",
                    help="both sides in one process per round, alternating every generation")
    ap.add_argument("--worker", choices=SIDES + ("both",), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.layers = args.layers or (6 if args.quick else 30)
    args.new_tokens = args.new_tokens or (32 if args.quick else 64)
    args.rounds = args.rounds or (2 if args.quick else 3)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    if min(args.batches + [args.layers, args.new_tokens, args.rounds, args.threads,
                           args.prompt_len, args.reps]) < 1:
        ap.error("--batches, --layers, --new-tokens, --rounds, --threads, --prompt-len and "
                 "--reps must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "model"
        if not (folder / "config.json").is_file():
            make_folder(folder, args.layers, args.seed)
        rows, same = compare(args, folder)
    print(f"threefold generate vs transformers generate (KV cache, greedy, fp32), "
          f"SmolLM2-135M shape with {args.layers} layers, prompts up to {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens, {args.threads} thread(s), best of "
          f"{args.reps} per {'process' if not args.one_process else 'side in one process'}, "
          f"{revision()}:")
    out = report("generate", rows, "ratio", 1.0)
    for b in args.batches:
        mine = [r["ratio"] for r in rows if r["batch"] == b]
        print(f"batch {b}: median ratio {statistics.median(mine):.3f}, tokens identical "
              f"in every round: {same[b]}")
    if not all(same.values()):
        print("warning: the two sides generated different tokens", file=sys.stderr)
    by_batch = {str(b): statistics.median(r["ratio"] for r in rows if r["batch"] == b)
                for b in args.batches}
    tok_s = {side: {str(b): statistics.median(r[f"{side}_tok_s"] for r in rows
                                              if r["batch"] == b) for b in args.batches}
             for side in SIDES}
    print(json.dumps({"bench": "generate", "speed_ratio": out["ratio_median"],
                      "ratio_by_batch": by_batch, "tokens_per_s": tok_s,
                      "same_tokens": all(same.values()), "layers": args.layers,
                      "new_tokens": args.new_tokens, "threads": args.threads,
                      "one_process": args.one_process,
                      "meets_goal": out["meets_goal"]}))


if __name__ == "__main__":
    main()
