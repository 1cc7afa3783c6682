"""Generation with the training model and its KV cache, and LoRA adapters exported for PEFT.
"""
