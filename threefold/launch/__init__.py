"""Launching a run: the arguments every training command shares, the checks before any
process starts, torchrun, Slurm, and the dry run.
"""
