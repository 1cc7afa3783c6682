"""What a rollout engine (GRPO with ``grpo.rollout_engine vllm``) adds to the process that holds
it: its copy of the policy's weights, its KV cache, vLLM's own runtime, and the bytes each
weight sync hands it.

- *Weights*: every weight in the training dtype, a tied head twice (it is built untied:
  ``threefold.generation.policy_weights.untied_config``). On a CPU, vLLM packs each linear
  weight for its GEMM kernels after loading: the linear layers keep the packed copy only, but
  the embedding and the head keep their weight and a packed copy beside it (the embedding is
  looked up, the head multiplies): vocab × hidden twice more.
- *KV cache*: what it was given (``grpo.vllm_kv_cache_mb``).
- *Runtime* (on a CPU): what a process gains by importing vLLM and running a tiny engine
  (built, loaded, one generation) beyond that engine's own weights and KV cache: vLLM's
  modules, its scheduler, sampler and kernels' state. Measured once per environment in a
  fresh process (``runtime_bytes``), as the process's own baseline is. On a GPU the runtime
  sits in host memory, not the device's, and is not counted.

Each sync sends the same tensors in fp32, once per optimiser step. Colocated, every training
rank holds an engine; a server (``grpo.vllm_mode server``) holds it in a process of its own.
Under the trainer's tensor parallelism a colocated engine is sharded as the trainer is (each
rank its shard of the weights, a KV cache of its heads), and each sync first all-gathers
every tensor the trainer slices over tp (``sync_tp_bytes``), a layer at a time.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import dataclasses

from threefold.accounting import num_parameters, parameter_numels
from threefold.accounting.lora_counts import adapter_numels
from threefold.config import ModelConfig
from threefold.layout import Layout, Workload


@dataclass(frozen=True)
class EngineBytes:
    """An engine's bytes: ``resident`` (weights, packed copies, KV cache; the process's
    runtime is counted apart), ``sync`` (handed over per optimiser step) and ``packed``
    (of ``resident``: the CPU kernels' copies of the embedding and the head)."""

    resident: int
    sync: int
    packed: int = 0


def engine_bytes(m: ModelConfig, dtype_bytes: int, kv_bytes: int,
                 on_cpu: bool = False, tp: int = 1) -> EngineBytes:
    """The engine of model ``m`` (resolved) in a dtype of ``dtype_bytes`` with ``kv_bytes``
    of KV cache; ``on_cpu``: vLLM's CPU backend (packed copies of the embedding and head);
    ``tp``: one of that many tensor-parallel workers (its shard of the weights, ``kv_bytes``
    of KV cache of its own; the norms, replicated, are a rounding error). ``sync`` is the
    whole model's, whatever ``tp``."""
    vocab = m.vocab_size * m.hidden_size
    weights = num_parameters(m) + (vocab if m.tie_word_embeddings else 0)
    packed = 2 * vocab * dtype_bytes // tp if on_cpu else 0
    # with fewer key-value heads than workers vLLM gives each worker one of them whole: its
    # k and v projections are a head's, not 1/tp of all of them
    kv = m.num_key_value_heads
    replicated = (m.num_hidden_layers * 2 * m.hidden_size * m.head_dim * (tp - kv)
                  if 1 < tp and kv < tp and not m.kv_lora_rank else 0)
    return EngineBytes((weights + replicated) * dtype_bytes // tp + packed + kv_bytes,
                       weights * 4, packed)


def engine_sleeps(on_gpu: bool, mode: str, staleness: int) -> bool:
    """Whether GRPO's vLLM engine sleeps while the trainer trains: on a GPU (vLLM has no
    sleep mode on a CPU), colocated, synchronous (with ``grpo.max_staleness`` it generates
    meanwhile). The run and the dry run both ask this."""
    return on_gpu and mode == "colocate" and not staleness


def sync_tp_bytes(m: ModelConfig, layout: Layout, work: Workload) -> int:
    """Bytes one rank sends over tp in a sync under the trainer's tensor parallelism: every
    tensor tp slices (a LoRA run's adapters too) is all-gathered, its slices padded alike
    (``threefold.generation.policy_weights``); 0 at tp 1. A tensor is sliced where a tp rank
    holds less of it than the whole."""
    tp = layout.tp
    if tp == 1:
        return 0
    one = dataclasses.replace(layout, tp=1)
    pairs = list(zip(parameter_numels(m, layout), parameter_numels(m, one)))
    if work.lora_r:
        pairs += list(zip(adapter_numels(m, tp, work.lora_r, work.lora_targets),
                          adapter_numels(m, 1, work.lora_r, work.lora_targets))
                      ) * m.num_hidden_layers
    return (tp - 1) * work.weight_bytes * sum(mine for mine, whole in pairs if mine < whole)


# The probe's engine: one block of two 32-feature heads (vLLM's CPU attention takes heads of
# 32 features or more), a 256-token vocabulary; its weights and KV cache are ~0.1 MB
PROBE_MODEL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 64, "tie_word_embeddings": False}
PROBE_KV = 1 << 20

_PROBE = (
    "import json, sys, tempfile\n"
    "from pathlib import Path\n"
    "import torch, threefold.training.train, threefold.parallel.distributed_world\n"
    "from threefold.config import ModelConfig\n"
    "from threefold.hardware.metrics import current_memory_bytes\n"
    "from threefold.model.decoder import CausalLM\n"
    "torch.set_num_threads(int(sys.argv[3]))\n"
    "torch.empty(1, device='meta') + 1\n"
    "cfg = ModelConfig(**json.loads(sys.argv[1])).resolved()\n"
    "model = CausalLM(cfg)\n"
    "model.init_weights(0)\n"
    "cpu = torch.device('cpu')\n"
    "before = current_memory_bytes(cpu)\n"
    "from threefold.generation.policy_weights import policy_weights, untied_config\n"
    "from threefold.generation.rollouts import Sampling\n"
    "from threefold.generation.vllm_rollouts import VLLMRollouts, write_engine_config\n"
    "from threefold.parallel.engines.engine import LocalEngine\n"
    "from threefold.config import OptimConfig\n"
    "from threefold.weights.hf_config import hf_config\n"
    "with tempfile.TemporaryDirectory() as tmp:\n"
    "    folder = write_engine_config(Path(tmp), untied_config(hf_config(cfg)))\n"
    "    vllm = VLLMRollouts(folder, sys.argv[2], 64, int(sys.argv[4]))\n"
    "    vllm.load(policy_weights(LocalEngine(model, OptimConfig()), cfg, untied_head=True), 0)\n"
    "    vllm.generate([[1, 2, 3], [4, 5]], [0, 1], Sampling(8, temperature=1.0))\n"
    "    print(current_memory_bytes(cpu) - before)\n")


def runtime_bytes(dtype: str, threads: int = 1) -> int:
    """vLLM's runtime on a CPU (the module doc): the resident bytes a fresh process that holds
    threefold's training code gains by running the tiny ``PROBE_MODEL`` engine in ``dtype``
    ('float32', 'bfloat16') on ``threads`` threads, with threefold's engine arguments
    (``VLLMRollouts``), less that engine's ``engine_bytes``. Measured once per Python,
    installed packages and threefold source (``plan.calibrate.measured_once``); 0 where it
    cannot be measured (vLLM not installed)."""
    import json

    from threefold.plan.calibrate import measured_once

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": str(int(threads)), "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    got = measured_once(f"vllm-runtime|{sys.executable}|{dtype}|{int(threads)}",
                        [sys.executable, "-c", _PROBE, json.dumps(PROBE_MODEL), dtype,
                         str(int(threads)), str(PROBE_KV)], env)
    if not got:
        return 0
    own = engine_bytes(ModelConfig(**PROBE_MODEL).resolved(),
                       2 if dtype == "bfloat16" else 4, PROBE_KV, on_cpu=True)
    return max(0, got[-1] - own.resident)
