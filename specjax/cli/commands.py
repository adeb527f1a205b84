"""`specjax` command line: the subcommands (one module each: generate, bench (offline), loadbench
(under load), serve, train-heads, tune-heads, warm-recycle, tune-recycle), the parser they make, and `main`."""

from __future__ import annotations

import argparse
import sys

from specjax.cli import (bench, flags, generate, loadbench, serve, train_heads, tune_heads, tune_recycle,
                         warm_recycle)

SUBCOMMANDS = (generate, bench, loadbench, serve, train_heads, tune_heads, warm_recycle, tune_recycle)  # each adds its parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


def compile_cache() -> str | None:
    """Turns on JAX's persistent compilation cache in `<specjax cache>/jax-compile` (see
    `specjax.models.catalog.cache_dir`), so a command run again loads its programs instead of
    compiling them. Every program is kept, however small or quick to compile. Left alone when JAX's
    own cache directory is set (JAX_COMPILATION_CACHE_DIR); SPECJAX_COMPILE_CACHE=0 turns it off.
    Returns the directory in use, or None."""
    import os

    import jax

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if os.environ.get("SPECJAX_COMPILE_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    from specjax.models import catalog

    path = str(catalog.cache_dir() / "jax-compile")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "distributed", False):
            import jax

            jax.distributed.initialize()  # before any other JAX call
            flags.quiet_unless_process_0()
        compile_cache()
        return args.func(args)
    except ValueError as e:  # our validation errors: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
