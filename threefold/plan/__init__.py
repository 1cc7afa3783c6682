"""The planner (``threefold plan``, ``threefold train --dry-run``): predicts what a layout costs
before launch, from the accounting (``threefold.accounting``) and the hardware.

Modules, bottom up: ``hardware`` (catalogue GPUs, clusters), ``calibrate`` (this machine
measured), ``compute`` (FLOPs and compute time), ``step`` (the step time: bubble, communication
and overlap), ``states`` / ``activations`` / ``memory`` (bytes per rank), ``candidates`` and
``search`` (the layouts searched and ranked), ``report`` (table, JSON, explanations),
``dryrun`` (one configuration checked before launch) and ``cli`` (the command). Nothing is
imported here, so that a module that needs one part (the runtime's MFU needs ``hardware``)
loads only that part.
"""
