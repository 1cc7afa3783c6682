"""The planner (``threefold plan``, ``threefold train --dry-run``): predicts what a layout costs
before launch, from the accounting (``threefold.accounting``), the rule book
(``threefold.layout``) and the hardware (``threefold.hardware``).

Modules, bottom up: ``cluster`` (clusters of catalogue GPUs), ``network`` (where each mesh
axis runs), ``collectives`` (their times), ``calibrate`` (this machine measured), ``baseline``
(a CPU process's own bytes: interpreter, torch, tokenizer, data), ``compute`` (FLOPs and
compute time), ``step`` (the step time: bubble, communication and overlap), ``states`` /
``activations`` / ``selective`` / ``mlp_tiling`` / ``mtp_bytes`` / ``moe_memory`` /
``memory`` / ``startup`` / ``terms`` (bytes per rank), ``rollout_engine`` (GRPO's colocated
engine), ``candidates``, ``splits`` and ``search`` (the layouts searched and ranked),
``longest`` (the longest sequence that fits), ``traps`` (what to know before launch),
``checkpoint_interval`` (how often to save, from a save's cost and the failure rate),
``report`` (table, JSON, explanations). The
command is ``threefold.commands.planning``, the dry run ``threefold.launch.dryrun``. Nothing
is imported here, so that a module that needs one part loads only that part.
"""
