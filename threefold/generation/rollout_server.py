"""vLLM as GRPO's rollout engine in a process of its own (``grpo.vllm_mode server``), reached
over a gloo process group of its own: the server and every training rank.

Why gloo, and this shape: vLLM's weight-transfer backends are NCCL and CUDA IPC (GPU only) and
TRL's server client refuses non-CUDA devices, so on a CPU the weights and the requests travel
over torch.distributed's gloo, point to point. The group is separate from the training world
(a ``TCPStore`` the server hosts, a ``ProcessGroupGloo`` over it): the server is rank 0, training
rank r is rank r + 1. Every message is a fixed-size int64 header then tensors whose sizes the
header gives, so each side knows what to receive:

- ``INIT`` (training rank 0, once): the model's config.json, dtype, longest sequence, KV cache,
  seed and tensor parallelism; the server writes the config to a folder of its own and starts
  vLLM from it (at tp > 1 with a worker process per shard: ``VLLMRollouts``).
- ``LOAD`` (training rank 0, after each optimiser step that precedes a rollout): the policy's
  weights, one tensor at a time (name, shape, fp32 values).
- ``GENERATE`` (every training rank, once per rollout): prompts, indices and sampling; the
  reply is the completions' tokens, their log-probs and the engine's policy version. Under
  the trainer's tensor parallelism the ranks of a tp group have the same prompts: the first
  asks for them and shares the reply over tp, the others ask for none.
- ``STOP`` (every training rank, at the end).

The server serves the training ranks in rank order, each until its ``GENERATE``: every rank
makes the same requests in the same order (the step count decides them), so nothing waits on
timing. A peer that stops answering fails the group's timeout, and the run stops with one line
naming the engine (``RolloutServerError``), never a hang.

``python3 -m threefold.generation.rollout_server --port P --clients N`` starts one; the
trainer starts it itself unless ``grpo.vllm_server`` names a running one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from threefold.generation.rollouts import Rollouts, Sampling

INIT, LOAD, GENERATE, STOP, TENSOR, END = 1, 2, 3, 4, 5, 6
DTYPES = ("float32", "bfloat16")
HEADER = 8


class RolloutServerError(RuntimeError):
    """The rollout server failed or did not answer in time."""


def group(host: str, port: int, rank: int, size: int, timeout_s: float):
    """The server's gloo group (rank 0 hosts its store)."""
    t = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=t)
    return dist.ProcessGroupGloo(store, rank, size, t)


def _send(pg, peer: int, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel():  # (an empty tensor is not sent: both sides know its size)
            pg.send([t.contiguous()], peer, 0).wait()


def _recv(pg, peer: int, like: torch.Tensor) -> torch.Tensor:
    if like.numel():
        pg.recv([like], peer, 0).wait()
    return like


def _header(*values: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.int64)
    h[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def _ints(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class ServerClient:
    """One training rank's end of the server's group: the same calls as ``VLLMRollouts``."""

    def __init__(self, address: str, rank: int, world: int, timeout_s: float = 600.0):
        host, _, port = address.rpartition(":")
        self.address, self.rank = address, rank
        self.version, self.start_seconds = -1, 0.0
        try:
            self.pg = group(host, int(port), rank + 1, world + 1, timeout_s)
        except Exception as e:  # noqa: BLE001 (one line naming the server)
            raise RolloutServerError(f"rollout engine vllm server at {address}: could not "
                                     f"join it: {e}") from None

    def _do(self, what: str, fn):
        try:
            return fn()
        except RolloutServerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RolloutServerError(f"rollout engine vllm server at {self.address}: {what} "
                                     f"failed: {str(e).splitlines()[0][:200]}") from None

    def init(self, hf_config: dict, dtype: str, max_len: int, kv_bytes: int, seed: int,
             tp: int = 1) -> None:
        """Start the server's engine (training rank 0) on ``tp`` tensor-parallel shards."""
        blob = torch.frombuffer(bytearray(json.dumps(hf_config).encode()), dtype=torch.uint8)
        self._do("starting the engine", lambda: (
            _send(self.pg, 0, _header(INIT, blob.numel(), DTYPES.index(dtype), max_len,
                                      kv_bytes, seed, tp), blob),
            self._reply_ok()))

    def _reply_ok(self) -> None:
        h = _recv(self.pg, 0, _header())
        if h[0] != END:
            raise RolloutServerError(f"rollout engine vllm server at {self.address}: it "
                                     "answered out of turn")
        self.start_seconds = float(h[1]) / 1e3

    def load(self, named, version: int) -> int:
        """Send the policy's weights (training rank 0); returns the bytes sent."""
        def run():
            sent = 0
            _send(self.pg, 0, _header(LOAD, version))
            for name, t in named:  # (through host memory: gloo sends host tensors)
                t = t.detach().float().contiguous().cpu()
                raw = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
                _send(self.pg, 0, _header(TENSOR, raw.numel(), t.dim(), t.numel()), raw,
                      _ints(t.shape), t.reshape(-1))
                sent += t.numel() * 4
            _send(self.pg, 0, _header(END))
            self._reply_ok()
            return sent
        out = self._do("the weight sync", run)
        self.version = version
        return out

    def generate(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> Rollouts:
        """Completions from the server (every training rank, once per rollout)."""
        def run():
            flat = [t for p in prompts for t in p]
            _send(self.pg, 0, _header(GENERATE, len(prompts), len(flat), s.max_new_tokens,
                                      s.top_k, -1 if s.eos_id is None else s.eos_id, s.seed),
                  torch.tensor([s.temperature, s.top_p], dtype=torch.float64),
                  _ints(map(len, prompts)), _ints(flat), _ints(indices))
            h = _recv(self.pg, 0, _header())
            n, total, version = int(h[0]), int(h[1]), int(h[2])
            lens = _recv(self.pg, 0, torch.zeros(n, dtype=torch.int64)).tolist()
            toks = _recv(self.pg, 0, torch.zeros(total, dtype=torch.int64)).tolist()
            lps = _recv(self.pg, 0, torch.zeros(total, dtype=torch.float64)).tolist()
            secs = float(_recv(self.pg, 0, torch.zeros(1, dtype=torch.float64))[0])
            cut = [sum(lens[:i]) for i in range(n + 1)]
            tokens = [toks[a:b] for a, b in zip(cut, cut[1:])]
            return Rollouts(tokens, [lps[a:b] for a, b in zip(cut, cut[1:])], secs, total,
                            version)
        return self._do("generation", run)

    def stop(self) -> None:
        self._do("stopping", lambda: _send(self.pg, 0, _header(STOP)))


def serve(port: int, clients: int, timeout_s: float = 600.0) -> None:
    """The server: rank 0 of a group with ``clients`` training ranks, until each stops."""
    import time

    from threefold.generation.vllm_rollouts import VLLMRollouts, write_engine_config

    pg = group("0.0.0.0", port, 0, clients + 1, timeout_s)
    engine, live = None, set(range(1, clients + 1))
    with tempfile.TemporaryDirectory() as tmp:
        while live:
            for peer in sorted(live):
                while True:
                    h = _recv(pg, peer, _header())
                    op = int(h[0])
                    if op == INIT:
                        blob = _recv(pg, peer, torch.zeros(int(h[1]), dtype=torch.uint8))
                        folder = write_engine_config(Path(tmp) / "model",
                                                     json.loads(bytes(blob.tolist())))
                        t0 = time.perf_counter()
                        engine = VLLMRollouts(folder, DTYPES[int(h[2])], int(h[3]), int(h[4]),
                                              seed=int(h[5]), tp=int(h[6]))
                        _send(pg, peer, _header(END, int((time.perf_counter() - t0) * 1e3)))
                    elif op == LOAD:
                        engine.load(_weights(pg, peer), int(h[1]))
                        _send(pg, peer, _header(END))
                    elif op == GENERATE:
                        _answer(pg, peer, h, engine)
                        break
                    else:  # STOP
                        live.discard(peer)
                        break
    if engine is not None:  # its worker processes (tensor parallelism) end with it
        engine.close()


def _weights(pg, peer: int):
    """The tensors a LOAD streams, as (name, tensor), until its END."""
    while True:
        h = _recv(pg, peer, _header())
        if int(h[0]) == END:
            return
        name = bytes(_recv(pg, peer, torch.zeros(int(h[1]), dtype=torch.uint8)).tolist())
        shape = _recv(pg, peer, torch.zeros(int(h[2]), dtype=torch.int64)).tolist()
        yield name.decode(), _recv(pg, peer, torch.zeros(int(h[3]))).view(shape)


def _answer(pg, peer: int, h: torch.Tensor, engine) -> None:
    n, total = int(h[1]), int(h[2])
    temp, top_p = _recv(pg, peer, torch.zeros(2, dtype=torch.float64)).tolist()
    lens = _recv(pg, peer, torch.zeros(n, dtype=torch.int64)).tolist()
    flat = _recv(pg, peer, torch.zeros(total, dtype=torch.int64)).tolist()
    indices = _recv(pg, peer, torch.zeros(n, dtype=torch.int64)).tolist()
    cut = [sum(lens[:i]) for i in range(n + 1)]
    prompts = [flat[a:b] for a, b in zip(cut, cut[1:])]
    eos = int(h[5])
    s = Sampling(int(h[3]), temp, top_p, int(h[4]), None if eos < 0 else eos, int(h[6]))
    # (no prompts: a training rank whose tp group's first rank asks for them all)
    out = engine.generate(prompts, indices, s) if n else Rollouts([], [], 0.0, 0,
                                                                  engine.version)
    toks = [t for c in out.tokens for t in c]
    _send(pg, peer, _header(n, len(toks), out.version), _ints(map(len, out.tokens)),
          _ints(toks), torch.tensor([v for c in out.logps for v in c], dtype=torch.float64),
          torch.tensor([out.seconds], dtype=torch.float64))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m threefold.generation.rollout_server",
                                 description="a vLLM rollout server for threefold grpo")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, required=True, help="training ranks")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    serve(args.port, args.clients, args.timeout_s)


if __name__ == "__main__":
    main()
