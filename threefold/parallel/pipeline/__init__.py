"""Pipeline parallelism: the executor that runs a schedule (``executor``), the stage split
(``stage``), the zero-bubble split backward (``split_backward``) and the ``pipeline``
command. The schedules as data (no torch) are ``threefold.schedules``'s."""
