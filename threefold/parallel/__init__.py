"""What a layout changes at run time: the order of application (``parallelize``), a rank's
``World`` (``world``, ``distributed_world``), placements and sharded start-up
(``placement``, ``materialize``), the model transforms (``transforms/``), the engines
(``engines/``) and the pipeline executor (``pipeline/``). The layout itself and its rules are
``threefold.layout``'s.
"""
