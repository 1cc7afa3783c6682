"""Model parallelism as changes to the model, applied from outside: tensor (+ sequence),
context and expert parallelism, FP8 linear layers, activation recompute, and the wrapper
classes they become.
"""
