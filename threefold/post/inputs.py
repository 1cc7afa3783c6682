"""What a post-training command reads besides the model, for its dry run's baseline
(``threefold.plan.baseline``): its records file (the built-in examples when none is given),
the chat template it renders them with, and the rows each record becomes."""

from __future__ import annotations

from threefold.plan.baseline import TaskData
from threefold.post.sft import example_path

DEFAULTS = {"sft": "sft.jsonl", "dpo": "dpo.jsonl", "reward": "reward.jsonl"}


def task_data(cmd: str, opts, rows_per_item: int = 1) -> TaskData:
    """The ``TaskData`` of ``threefold <cmd>`` with options ``opts`` (``rows_per_item``: the
    sequences each record puts through the model)."""
    if cmd == "grpo":  # prompts alone are kept (completions are made each step); "": built-in
        return TaskData(opts.prompts, opts.chat_template, rollout_engine=opts.rollout_engine,
                        engine_kv_bytes=opts.vllm_kv_cache_mb << 20,
                        engine_mode=opts.vllm_mode, engine_tp=opts.vllm_server_tp,
                        engine_async=opts.max_staleness > 0)
    return TaskData(getattr(opts, "data", "") or str(example_path(DEFAULTS[cmd])),
                    opts.chat_template, rows_per_item)
