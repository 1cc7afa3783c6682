"""threefold: an open training stack for large language models across many devices."""

__version__ = "0.1.0"
