"""fastio: a data layer for training on GPU clusters."""

__version__ = "0.1.0"
__all__ = ["__version__"]
