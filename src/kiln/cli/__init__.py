"""The ``kiln`` command."""

from kiln.cli.serve import main

__all__ = ["main"]
