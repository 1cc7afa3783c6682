"""Where GRPO's completions come from, for one training rank (``grpo.rollout_engine``), and the
correction for sampling with an engine that is not the trainer.

``builtin`` generates with the training model (``threefold.generation.generate``). ``vllm``
keeps a colocated vLLM engine (``threefold.generation.vllm_rollouts``) per rank: started at
set-up from the model's config.json alone, synced with the policy's weights
(``threefold.generation.policy_weights``) whenever the policy has stepped since the last sync,
that is, before the first rollout and after every optimiser step that precedes one. The sync
is collective under ZeRO-3 (the units are gathered) and tensor parallelism (the slices are
gathered over tp): every rank syncs at the same steps, since the step count alone decides it.
Its seconds and bytes are logged (``rollout/sync_seconds``, ``rollout/sync_bytes``, and under
tp the bytes this rank sent to gather, ``rollout/sync_tp_bytes``), with the engine's start-up
time once. Under tensor parallelism the colocated engine is sharded as the trainer is: the
ranks of a training tp group are the workers of one engine, each asked the same; with a server
the group's first rank asks for the group's completions and broadcasts them over tp.

Bounded staleness (``grpo.max_staleness`` k >= 1, vllm only): when a training step's rollout is
done, the next step's starts in a background thread with the weights as they are, and runs
while the step trains (torch's kernels release the GIL). Those completions then train one
policy version later: staleness 1, within any k >= 1; each records its version, logged as
``rollout/staleness``. Their ratio is taken against the engine's own log-probs (the policy
that sampled them), clipped by epsilon as usual. k = 0 is the synchronous loop, unchanged.

Importance correction (``importance_weights``): vLLM's log-probability of a sampled token
differs from the trainer's for the same weights (other kernels, bf16 rounding); the
token loss is weighed by the ratio π_trainer / π_engine, truncated at a cap per token
(``token_truncate``, TIS as veRL and TRL apply it) or, per completion, zeroed when the
sequence's ratio leaves [1/cap, cap] (``sequence_mask``, TRL's default), or not at all
(``none``). The mismatch is logged each step under TRL's names.
"""

from __future__ import annotations

import atexit
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from threefold.config import ConfigError
from threefold.generation.generate import generate
from threefold.generation.policy_weights import policy_weights, untied_config
from threefold.generation.rollout_server import RolloutServerError
from threefold.generation.rollouts import (ROLLOUT_ENGINES, VLLM_INSTALL, Rollouts, Sampling,
                                           vllm_installed)
from threefold.plan.rollout_engine import engine_sleeps
from threefold.weights.hf_config import hf_config

IMPORTANCE_MODES = ("token_truncate", "sequence_mask", "none")
VLLM_MODES = ("colocate", "server")


def check_engine(engine: str, importance: str, cap: float, staleness: int = 0,
                 iterations: int = 1, mode: str = "colocate", server_tp: int = 1) -> None:
    """ConfigError for an unknown engine, mode or correction, or a staleness or server
    tensor parallelism it cannot give."""
    if mode not in VLLM_MODES:
        raise ConfigError(f"grpo.vllm_mode: '{mode}' is not one of {', '.join(VLLM_MODES)}")
    if server_tp < 1 or (server_tp > 1 and (mode != "server" or engine != "vllm")):
        raise ConfigError(f"grpo.vllm_server_tp: {server_tp} needs >= 1, and > 1 needs "
                          "grpo.rollout_engine vllm with grpo.vllm_mode server (a colocated "
                          "engine lives in its training rank's process)")
    if engine not in ROLLOUT_ENGINES:
        raise ConfigError(f"grpo.rollout_engine: '{engine}' is not one of "
                          f"{', '.join(ROLLOUT_ENGINES)}")
    if importance not in IMPORTANCE_MODES:
        raise ConfigError(f"grpo.importance_sampling: '{importance}' is not one of "
                          f"{', '.join(IMPORTANCE_MODES)}")
    if not cap > 1:
        raise ConfigError(f"grpo.importance_sampling_cap: {cap} must be > 1")
    if staleness < 0 or (staleness and engine != "vllm"):
        raise ConfigError(f"grpo.max_staleness: {staleness} needs >= 0, and > 0 needs "
                          "grpo.rollout_engine vllm (the builtin engine is the training model "
                          "itself, busy training)")
    if staleness and iterations > 1:
        raise ConfigError(f"grpo.max_staleness: {staleness} with grpo.num_iterations "
                          f"{iterations}: a generation is trained on once when the next one "
                          "is already under way; use grpo.num_iterations 1")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def server_layout(cfg, o) -> tuple:
    """(engine, server tp, the model's shape, mode, staleness) the rule book checks GRPO's
    options ``o`` with (``layout.task_layout``): the shape only for a server sharded over
    workers (the checkpoint's configuration when ``checkpoint.init_from`` gives the weights;
    else None: the preset's)."""
    tp = o.vllm_server_tp if o.vllm_mode == "server" else 1
    shape = None
    if tp > 1 and cfg.checkpoint.init_from:
        from threefold.weights.model_source import init_from_model

        shape = init_from_model(cfg)[0]
    return o.rollout_engine, tp, shape, o.vllm_mode, o.max_staleness


def check_installed(engine: str) -> None:
    """ConfigError when vLLM is asked for and not installed (after the layout's rules: a
    layout the engine cannot run is refused for that first)."""
    if engine == "vllm" and not vllm_installed():
        raise ConfigError(f"grpo.rollout_engine: vllm is not installed here; install it with "
                          f"{VLLM_INSTALL}, or use grpo.rollout_engine builtin")


class RolloutSource:
    """One rank's completions for GRPO: ``complete(prompts, indices, sampling)``."""

    def __init__(self, run, engine: str, max_len: int, kv_cache_mb: int, mode: str = "colocate",
                 server: str = "", server_tp: int = 1, staleness: int = 0):
        self.run = run
        self.engine = None
        self.started = 0.0
        self.ahead: tuple | None = None  # (request, its completions to come: a Future, figures)
        self.worker: ThreadPoolExecutor | None = None
        self.server = None  # the server process this rank started (server mode, rank 0)
        self.sender = True  # whether this rank sends the weights (server mode: rank 0)
        comm = run.world.comm  # a server under tp: one request per tp group (``_ask``)
        self.split_tp = mode == "server" and comm is not None and comm.size("tp") > 1
        if engine != "vllm":
            return
        dtype = "bfloat16" if run.dtype == torch.bfloat16 else "float32"
        conf = untied_config(hf_config(run.model_cfg))
        if mode == "server":
            self._connect(server, conf, dtype, max_len, kv_cache_mb << 20, server_tp)
            return
        from threefold.generation.vllm_rollouts import VLLMRollouts, write_engine_config

        folder = write_engine_config(run.out / "rollout_engine" / f"rank{run.world.rank}", conf)
        # under tensor parallelism the training tp group is the engine's (every rank a worker)
        group = comm.members("tp") if comm is not None and comm.size("tp") > 1 else ()
        self.engine = VLLMRollouts(folder, dtype, max_len, kv_cache_mb << 20,
                                   seed=run.cfg.train.seed, colocated_tp=group,
                                   sleep=engine_sleeps(run.device.type == "cuda", mode,
                                                       staleness),
                                   rank=run.world.rank if comm is not None else None)
        self.started = self.engine.start_seconds

    def _connect(self, address: str, conf: dict, dtype: str, max_len: int, kv: int,
                 tp: int) -> None:
        """Server mode: join the server at ``address`` (rank 0 starts one first when none is
        given, at MASTER_ADDR and the port after MASTER_PORT's hundred), rank 0 starts its
        engine."""
        from threefold.generation.rollout_server import ServerClient

        w = self.run.world
        if not address:
            port = int(os.environ.get("MASTER_PORT", "29500")) + 100
            address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"
            if w.rank == 0:
                # (without torchrun's variables: the server's workers are a world of their own)
                env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
                self.server = subprocess.Popen(
                    [sys.executable, "-m", "threefold.generation.rollout_server", "--port",
                     str(port), "--clients", str(w.world_size)], env=env)
        self.engine = ServerClient(address, w.rank, w.world_size)
        atexit.register(self.close)
        self.sender = w.rank == 0
        if self.sender:
            self.engine.init(conf, dtype, max_len, kv, self.run.cfg.train.seed, tp)
            self.started = self.engine.start_seconds

    def close(self) -> None:
        """End the server connection, and the server this rank started (also at exit, for a
        process that ends before the task's ``close``: a server left waiting would hold its
        port until its timeout); or stop the colocated engine. A second call does nothing."""
        engine, self.engine = self.engine, None
        if self.worker is not None:  # (a prefetch still generating ends first)
            self.worker.shutdown(wait=True)
        try:
            if hasattr(engine, "stop"):
                engine.stop()
            elif engine is not None:
                engine.close()
        finally:
            if self.server is not None:
                try:
                    self.server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.server.kill()

    def sync(self) -> dict[str, float]:
        """Send the policy's weights when it has stepped since the engine's; the figures."""
        version = self.run.engine.optim_step()
        if self.engine is None or self.engine.version == version:
            return {}
        t0, comm = time.perf_counter(), self.run.world.comm
        if not self.sender and 0 not in comm.members("tp"):
            comm = None  # (a server's weights come from rank 0's tp group: no gathers here)
        gathered = _tp_bytes(comm)
        named = policy_weights(self.run.engine, self.run.model_cfg, untied_head=True, comm=comm)
        if not self.sender:  # server mode: rank 0 sends; the others take part in the gathers
            for _ in named:
                pass
            self.engine.version = version
            return {}
        sent = self.engine.load(named, version)
        figures = {"rollout/sync_seconds": time.perf_counter() - t0, "rollout/sync_bytes": sent}
        if comm is not None and comm.size("tp") > 1:  # what this rank sent to gather slices
            figures["rollout/sync_tp_bytes"] = _tp_bytes(comm) - gathered
        return figures

    def prefetch(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> None:
        """Start generating the next step's completions now, with the policy as it is, in a
        background thread, while this step trains (``grpo.max_staleness`` >= 1): they reach
        the trainer one policy version old. The weights are synced here, in the main thread
        (collective under ZeRO-3), never while the engine generates."""
        figures = self.sync()
        if self.worker is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        job = self.worker.submit(self._ask, prompts, indices, s)
        self.ahead = ((_request(prompts, indices), s), job, figures)

    def complete(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> Rollouts:
        """Completions of ``prompts``, completion i seeded by ``indices[i]`` (the prefetched
        ones when this is the request ``prefetch`` started)."""
        if self.ahead is not None:  # (another request, evaluation's, waits for it: one
            request, job, figures = self.ahead  # engine, one request at a time)
            wait([job])
            if request == (_request(prompts, indices), s):
                self.ahead = None
                out = self._shared(job.result)  # (an error in the thread is raised here)
                out.figures.update(figures)
                return out
        if self.engine is not None:
            figures = self.sync()
            if self.started:
                figures["rollout/engine_start_seconds"], self.started = self.started, 0.0
            out = self._shared(lambda: self._ask(prompts, indices, s))
            out.figures.update(figures)
            return out
        model = self.run.engine.model
        tp = model.tp_size
        # under ZeRO-3 each forward gathers one unit at a time, as training does: the whole
        # model is never on the rank (more gathers per token, the memory the planner promised)
        res = generate(model, prompts, s.max_new_tokens, temperature=s.temperature,
                       top_p=s.top_p, top_k=s.top_k, eos_id=s.eos_id, seed=s.seed,
                       prompt_indices=indices, comm=self.run.world.comm if tp > 1 else None,
                       pad_id=s.pad_id)
        return Rollouts(res.tokens, None, res.seconds, sum(res.lengths),
                        self.run.engine.optim_step())


    def _ask(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> Rollouts:
        """The engine's completions; a server's, under the trainer's tensor parallelism, for
        the tp group's first rank only (the others ask for none: ``_shared``)."""
        if self.split_tp and self.run.world.comm.rank("tp"):
            prompts, indices = [], []
        return self.engine.generate(prompts, indices, s)

    def _shared(self, get) -> Rollouts:
        """``get()``'s completions; a server's under the trainer's tensor parallelism, as the
        tp group's first rank got them, on every rank of the group (counted on tp), in the
        main thread. A failure there is every rank's, raised on each (no peer is left
        waiting in the broadcast)."""
        if not self.split_tp:
            return get()
        try:
            out = (get(), None)
        except RolloutServerError as e:
            out = (None, str(e))
        got, error = self.run.world.comm.broadcast_object(out, "tp")
        if error is not None:
            raise RolloutServerError(error)
        return got


def _tp_bytes(comm) -> int:
    """The bytes this rank has sent on the tp axis so far (0 without a communication layer)."""
    return sum(comm.totals().get("tp", {}).values()) if comm is not None else 0


def _request(prompts: list[list[int]], indices: list[int]) -> tuple:
    return tuple(map(tuple, prompts)), tuple(indices)


def importance_weights(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float) -> torch.Tensor:
    """Per-token weights (rows, T) for the loss: the trainer's log-probs ``old`` against the
    engine's ``sampled`` on the completion tokens ``mask`` (module doc)."""
    diff = (old - sampled) * mask
    if mode == "token_truncate":
        return torch.exp(diff).clamp(max=cap)
    if mode == "sequence_mask":
        seq = diff.sum(1, keepdim=True)
        keep = (seq <= math.log(cap)) & (seq >= -math.log(cap))
        return keep.to(old.dtype).expand_as(old)
    return torch.ones_like(old)


def mismatch_sums(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor) -> np.ndarray:
    """[tokens, Σ|Δlogp|, max|Δlogp|, Σ ratio, min ratio, max ratio] over the completion
    tokens, to be reduced over the data-parallel ranks (sum, sum, max, sum, min, max)."""
    m = mask.bool()
    if not m.any():
        return np.array([0.0, 0.0, 0.0, 0.0, math.inf, -math.inf])
    d = (old - sampled)[m].abs().double()
    r = weights[m].double()
    return np.array([float(m.sum()), float(d.sum()), float(d.max()), float(r.sum()),
                     float(r.min()), float(r.max())])


def mismatch_figures(sums: np.ndarray, maxes: np.ndarray, mins: np.ndarray) -> dict[str, float]:
    """TRL's sampling metrics from ``mismatch_sums`` reduced over the ranks (three ways)."""
    n = max(sums[0], 1.0)
    return {"sampling/sampling_logp_difference/mean": sums[1] / n,
            "sampling/sampling_logp_difference/max": maxes[2],
            "sampling/importance_sampling_ratio/mean": sums[3] / n,
            "sampling/importance_sampling_ratio/min": mins[4],
            "sampling/importance_sampling_ratio/max": maxes[5]}
