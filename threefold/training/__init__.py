"""The training loop and what it works on: building a run, one step, the task, what a run
reports, checkpoints saved and resumed, preemption.
"""
