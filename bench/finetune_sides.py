"""One side of ``bench_finetune`` in its own process: threefold or TRL (+ PEFT), SFT or DPO,
full fine-tuning or LoRA, on the folder and data ``finetune_setup`` wrote. Prints one JSON
line: each step's seconds and loss, and the process's peak resident set.

    python3 bench/finetune_sides.py SIDE TASK MODE --root DIR --out DIR --steps N
        --batch B --seq-len S --threads T [--lr LR] [--lora-r 16] [--lora-alpha 32]

Held equal on both sides (the TRL configuration states each): AdamW (β 0.9/0.95, ε 1e-8, no
weight decay), a constant learning rate without warm-up, gradient clipping at 1, fp32
without autocast, no recomputation (TRL 1.16 defaults to bf16 and gradient checkpointing:
both set off), one micro-batch per step (the whole global batch), loss averaged over the
batch's trained tokens (SFT: TRL divides by ``num_items_in_batch``, the batch's count of
labels, as threefold divides by the assistant tokens of the global batch) or pairs (DPO),
LoRA dropout 0 with the adapters' initial values copied from threefold's (``initial_weight``:
threefold draws A from a generator seeded by (train.seed, name), B = 0), DPO β 0.1 sigmoid
with the reference log-probs computed once before training (threefold always does; TRL's
``precompute_ref_log_probs=True``; under LoRA both score the base, adapters off or B = 0).

Peak RSS: threefold resets the high-water mark (VmHWM) between the phases of a run; this
process reads it before each reset, so both sides report the whole process's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA = 0.1


def vm_hwm() -> int:
    """This process's resident high-water mark in bytes (Linux VmHWM)."""
    from threefold.hardware.metrics import proc_status_kib

    return (proc_status_kib("VmHWM") or 0) * 1024


# --------------------------------------------------------------------------------------------
# threefold
# --------------------------------------------------------------------------------------------
def threefold_argv(a) -> list[str]:
    """``threefold sft|dpo`` options for the bench's run."""
    root, task = Path(a.root), a.task
    argv = ["--checkpoint.init_from", str(root / "hf"),
            f"--{task}.data", str(root / f"{task}.jsonl"),
            f"--{task}.val_data", str(root / f"{task}_val.jsonl"),
            "--train.output_dir", a.out, "--train.steps", str(a.steps),
            "--train.global_batch_size", str(a.batch), "--train.micro_batch_size", str(a.batch),
            "--data.seq_len", str(a.seq_len), "--train.dtype", "float32",
            "--train.recompute", "none", "--train.eval_batches", "1",
            "--train.eval_interval", "0", "--train.progress", "off",
            "--train.log_interval", "1000", "--checkpoint.save_final", "false",
            "--train.seed", "0", "--optim.lr", str(a.lr), "--optim.warmup_steps", "0",
            "--optim.min_lr_ratio", "1.0", "--optim.weight_decay", "0.0",
            "--optim.beta1", "0.9", "--optim.beta2", "0.95", "--optim.eps", "1e-8",
            "--optim.grad_clip", "1.0"]
    if a.host_mmap_mb:  # the host allocator's setting (the command's default otherwise)
        argv += ["--train.host_mmap_threshold_mb", a.host_mmap_mb]
    if task == "sft":
        argv += ["--data.document_mask", "true"]
    else:
        argv += ["--dpo.beta", str(BETA), "--dpo.loss_type", "sigmoid"]
    if a.mode == "lora":
        argv += ["--lora.r", str(a.lora_r), "--lora.alpha", str(a.lora_alpha),
                 "--lora.dropout", "0.0", "--lora.target_modules", "all-linear"]
    return argv


def run_threefold(a) -> dict:
    """``threefold sft|dpo`` in this process; per-step seconds and losses from its
    metrics.jsonl (seconds = tokens_per_step / tokens_per_second, the step's own clock)."""
    import threefold.training.train as tt
    from threefold.commands.posttrain import dpo_main, sft_main

    peak = [0]
    reset = tt.reset_peak_memory

    def keep_peak_then_reset(device):  # the phase's peak would be lost otherwise
        peak[0] = max(peak[0], vm_hwm())
        reset(device)

    tt.reset_peak_memory = keep_peak_then_reset
    predicted = dry_run_peak(a)
    code = (sft_main if a.task == "sft" else dpo_main)(threefold_argv(a))
    if code:
        raise SystemExit(f"threefold {a.task} failed ({code})")
    out = Path(a.out)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = json.loads((out / "summary.json").read_text())["tokens_per_step"]
    return {"losses": [r["loss"] for r in recs],
            "seconds": [per_step / r["tokens_per_second"] for r in recs],
            "peak_rss": max(peak[0], vm_hwm()), "predicted_peak": predicted}


def dry_run_peak(a) -> float:
    """What ``threefold sft|dpo ... --dry-run`` predicts this process peaks at: the larger of
    its start-up and step peaks (the baseline included), for the same configuration."""
    from threefold.launch.dryrun import as_rows, predict
    from threefold.commands.posttrain import ROWS_PER_ITEM, build_config, parse_task_options
    from threefold.post.inputs import task_data

    opts, rest = parse_task_options(a.task, threefold_argv(a))
    rows = ROWS_PER_ITEM.get(a.task, 1)
    cfg = as_rows(build_config(a.task, None, rest), rows)
    peaks = predict(cfg, 1, task=task_data(a.task, opts, rows)).peaks
    return max(peaks["startup"], peaks["step"])


# --------------------------------------------------------------------------------------------
# TRL + PEFT
# --------------------------------------------------------------------------------------------
def trl_common(a) -> dict:
    """The TRL configuration fields both trainers share (see the module doc)."""
    return dict(output_dir=a.out, per_device_train_batch_size=a.batch, max_steps=a.steps,
                gradient_accumulation_steps=1, learning_rate=a.lr, lr_scheduler_type="constant",
                warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
                report_to="none", save_strategy="no", eval_strategy="no", use_cpu=True,
                seed=0, data_seed=0, max_length=a.seq_len, disable_tqdm=True,
                dataloader_drop_last=False, bf16=False, fp16=False,
                gradient_checkpointing=False, dataloader_num_workers=0)


def trl_model(a):
    """The HF folder's model in fp32, with PEFT LoRA adapters under ``--mode lora`` whose
    initial values are threefold's (copied in)."""
    import torch
    from transformers import AutoModelForCausalLM

    from threefold.model.decoder import initial_weight

    model = AutoModelForCausalLM.from_pretrained(Path(a.root) / "hf", dtype=torch.float32)
    if a.mode != "lora":
        return model
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(
        r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, target_modules=TARGETS,
        task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                ours = name.removeprefix("base_model.model.").replace(".default", "")
                # cfg is only read for base weights; adapters need (seed, name) alone
                p.copy_(initial_weight(ours, tuple(p.shape), None, 0))
    return model


def timed(trainer_cls):
    """``trainer_cls`` recording each step's loss (unrounded: TRL logs 4 decimals) and the
    wall clock at each step's end."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    class Timed(trainer_cls):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.raw_losses, self.clock = [], Clock()
            self.add_callback(self.clock)

        def compute_loss(self, model, inputs, *args, **kw):
            out = super().compute_loss(model, inputs, *args, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            if model.training:
                self.raw_losses.append(loss.item())
            return out

    return Timed


def run_trl(a) -> dict:
    """TRL's SFTTrainer (bfd packing, padding-free, assistant-only loss) or DPOTrainer."""
    import datasets
    import trl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(a.root) / "hf")
    recs = [json.loads(x) for x in (Path(a.root) / f"{a.task}.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list(recs)
    if a.task == "sft":
        args = trl.SFTConfig(**trl_common(a), packing=True, packing_strategy="bfd",
                             padding_free=True, assistant_only_loss=True, loss_type="nll",
                             completion_only_loss=None, shuffle_dataset=False)
        cls = timed(trl.SFTTrainer)
    else:
        args = trl.DPOConfig(**trl_common(a), beta=BETA, loss_type=["sigmoid"],
                             label_smoothing=0.0, precompute_ref_log_probs=True,
                             precompute_ref_batch_size=a.batch)
        cls = timed(trl.DPOTrainer)
    trainer = cls(model=trl_model(a), args=args, train_dataset=ds, processing_class=tok)
    trainer.clock.ends = [time.perf_counter()]  # steps only: set-up and scoring before
    trainer.train()
    ends = trainer.clock.ends
    return {"losses": trainer.raw_losses[:a.steps],
            "seconds": [b - e for e, b in zip(ends, ends[1:])], "peak_rss": vm_hwm()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("side", choices=("threefold", "trl"))
    ap.add_argument("task", choices=("sft", "dpo"))
    ap.add_argument("mode", choices=("full", "lora"))
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    for name, default in (("steps", 4), ("batch", 8), ("seq-len", 256), ("threads", 2),
                          ("lora-r", 16), ("lora-alpha", 32)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--host-mmap-mb", default="",
                    help="threefold's train.host_mmap_threshold_mb (default: the command's)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    got = (run_threefold if a.side == "threefold" else run_trl)(a)
    print("RESULT " + json.dumps(dict(got, threads=torch.get_num_threads(),
                                      pid=os.getpid())), flush=True)


if __name__ == "__main__":
    main()
