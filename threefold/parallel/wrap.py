"""The one way a parallelism changes a module: it turns the instance into a wrapper class.

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


_COMPOSED: dict[tuple[type, type], type] = {}


def composed(wrapper: type, base: type) -> type:
    """``wrapper`` over ``base``: ``wrapper`` itself when it already derives from ``base``,
    else one class (made once) that is both, named as ``wrapper``, so that a module another
    parallelism wrapped before keeps that wrapper's behaviour under this one (tensor
    parallelism's sub-layer under context parallelism's attention)."""
    if issubclass(wrapper, base):
        return wrapper
    if (wrapper, base) not in _COMPOSED:
        _COMPOSED[wrapper, base] = type(wrapper.__name__, (wrapper, base),
                                        {"__doc__": wrapper.__doc__,
                                         "__module__": wrapper.__module__})
    return _COMPOSED[wrapper, base]


def wrap(module: nn.Module, wrapper: type, **settings) -> nn.Module:
    """``become`` ``wrapper`` composed over the module's present class (``composed``)."""
    return become(module, composed(wrapper, type(module)), **settings)

