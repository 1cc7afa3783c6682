"""Engines: what holds the parameters, gradients and optimiser state of a rank, and how they
are synchronised: one process, data parallel, ZeRO 1-3, AdamW on the device or the host.
"""
