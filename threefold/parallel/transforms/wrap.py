"""The one way a parallelism changes a module: it turns the instance into a wrapper class.

A wrapper is a subclass of the module's own class (``ContextParallelAttention`` of
``Attention``, ``ExpertParallelExperts`` of ``Experts``) that overrides a method and
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
    ``wrap`` composes a wrapper over a family's own subclass) and declare every setting as a class
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
    else one class (made once) that is both, so that a module another parallelism wrapped
    before keeps that wrapper's behaviour under this one (tensor parallelism's sub-layer under
    context parallelism's attention), and a family's own class (``Gemma3ForCausalLM``) the
    wrapper's behaviour. Named as ``wrapper``, but over a family's class (one with a
    ``family``) a wrapper named for the neutral class it derives from keeps the family's name
    after its own prefix: ``TensorParallelCausalLM`` over ``Gemma3ForCausalLM`` is
    ``TensorParallelGemma3ForCausalLM``."""
    if issubclass(wrapper, base):
        return wrapper
    if (wrapper, base) not in _COMPOSED:
        name = wrapper.__name__
        neutral = next(c for c in wrapper.__mro__[1:] if issubclass(base, c))
        if getattr(base, "family", "") and name.endswith(neutral.__name__):
            name = name.removesuffix(neutral.__name__) + base.__name__
        _COMPOSED[wrapper, base] = type(name, (wrapper, base),
                                        {"__doc__": wrapper.__doc__,
                                         "__module__": wrapper.__module__})
    return _COMPOSED[wrapper, base]


def wrap(module: nn.Module, wrapper: type, **settings) -> nn.Module:
    """``become`` ``wrapper`` composed over the module's present class (``composed``)."""
    return become(module, composed(wrapper, type(module)), **settings)

