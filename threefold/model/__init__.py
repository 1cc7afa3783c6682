"""The decoder every family builds, and its parts: attention, latent attention, norms,
kernels, the chunked head and loss, mixture of experts, the KV cache, LoRA adapters.
"""
