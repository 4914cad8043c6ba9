"""polyattn: attention mechanisms that keep more than one linear-attention state at sub-quadratic cost."""

__version__ = "0.1.0"

from polyattn import ops  # noqa: E402

__all__ = ["ops", "__version__"]
