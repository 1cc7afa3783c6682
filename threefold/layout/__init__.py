"""A run's layout, described once, and the rule book every command checks it by.

``description``: ``Layout`` (the degrees of every parallel axis and how a step runs on them)
and ``Workload`` (what a step trains), read by the runtime, the launcher, the dry run and the
planner; ``ranks``: the rank arithmetic on a layout; ``rules`` (a package): every rule that
refuses a layout, one function and one message each; ``checks``: the order the commands call
them in.
Imports no torch.
"""

from threefold.layout.checks import check_layout, task_layout, validate_layout
from threefold.layout.description import Layout, Workload, recompute_of_label

__all__ = ["Layout", "Workload", "check_layout", "recompute_of_label", "task_layout",
           "validate_layout"]
