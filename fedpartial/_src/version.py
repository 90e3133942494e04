"""The package's version (one place: ``fedpartial.__version__`` and ``fedpartial --version`` read it)."""

__version__ = "0.2.0"
