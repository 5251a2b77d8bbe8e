"""sacpolicy: speculative decoding plus adaptive computation."""

__version__ = "0.1.0"
