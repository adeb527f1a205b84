"""The `specjax` command line: flags in, library calls out."""

from specjax.cli.commands import main

__all__ = ["main"]
