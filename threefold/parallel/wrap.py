"""How a parallelism changes a module: it turns the instance into a wrapper class (tensor
parallelism's f and g at each sub-layer's edges are forward hooks; nothing else is hooked).

A wrapper is a subclass of the module's own class (``ContextParallelAttention`` of
``LlamaAttention``, ``ExpertParallelExperts`` of ``Experts``) that overrides a method and
declares its settings as class attributes. ``become`` switches the instance's class in place:
parameter names and state dicts do not change, every holder of the module (pipeline chunks
share modules) sees the new behaviour, and ``print(model)`` names what runs. No function is
stamped on an instance and no undeclared attribute is set from outside
(``tests/test_code_shape.py`` checks ``threefold/parallel/`` for it).
"""

from __future__ import annotations

from torch import nn


def become(module: nn.Module, cls: type, **settings) -> nn.Module:
    """Turn ``module`` into a ``cls`` in place and give it ``settings``; returns it.

    ``cls`` must be a subclass of the module's own class (so nothing the module was is lost:
    a family's own subclass would need its own wrapper) and declare every setting as a class
    attribute (its default), so that the wrapper's whole state is visible in its class."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(module).__name__}: "
                        f"turning the module into it would drop what its class adds")
    undeclared = [k for k in settings if not hasattr(cls, k)]
    if undeclared:
        raise TypeError(f"{cls.__name__} declares no {', '.join(undeclared)}")
    module.__class__ = cls
    for k, v in settings.items():
        setattr(module, k, v)
    return module
