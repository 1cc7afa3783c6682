"""Accelerators: the catalogue of datasheet figures, this CPU's measured matmul rate, and the
readings a run reports (MFU, memory).
"""
