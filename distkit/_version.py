"""distkit's version, in a leaf module: code that records it (checkpoints) imports this, not
the package, whose ``__init__`` imports that code (an import cycle otherwise)."""

__version__ = "0.1.0"
