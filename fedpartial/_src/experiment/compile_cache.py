"""The cache folder, and JAX's persistent compilation cache in it, so a second identical run does not compile.

The folder is ``$XDG_CACHE_HOME/fedpartial`` (else ``~/.cache/fedpartial``); compiled programs go to its
``jax`` folder, ``--conv-impl auto``'s measurements to its ``conv-impl.json``.  A compilation cache folder
the user (or a test suite) has already given JAX (``JAX_COMPILATION_CACHE_DIR``) is left as it is.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["cache_folder", "enable"]


def cache_folder() -> str:
    """``$XDG_CACHE_HOME/fedpartial``, else ``~/.cache/fedpartial`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fedpartial")


def enable(on: bool = True) -> str | None:
    """Turns JAX's persistent compilation cache on in :func:`cache_folder`'s ``jax`` folder (every compiled
    program is kept, however quick it was to compile); returns the folder in use (None: ``on`` is False and no
    folder was set before).  A folder already set is kept; one that cannot be created leaves the cache off."""
    current = jax.config.jax_compilation_cache_dir
    if current or not on:
        return current or None
    path = os.path.join(cache_folder(), "jax")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # a program compiled before this call found no cache: look again
    return path
