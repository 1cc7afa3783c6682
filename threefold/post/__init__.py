"""Post-training on the same engine: supervised fine-tuning (``SFTTask``) and direct preference
optimisation (``DPOTask``) are Tasks (``threefold.training.task``) that the ordinary training loop
runs under any layout; ``threefold.commands.posttrain`` holds ``threefold sft`` and ``threefold
dpo``.
"""

from threefold.post.dpo import DPOOptions, DPOTask, dpo_loss
from threefold.post.sft import SFTOptions, SFTTask, example_path

__all__ = ["DPOOptions", "DPOTask", "SFTOptions", "SFTTask", "dpo_loss", "example_path"]
