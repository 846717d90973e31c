"""XLA's persistent compilation cache for experiment runs.

A run compiles each architecture's round, evaluation and initialisation programs; compiling dominates short runs
on CPU (a GeFL client's generator and its Adam state took about 13 s to compile per architecture on a 2-core CPU,
ten architectures per run). With the cache on disk, a program compiled once (in another architecture group with
the same program, another seed of a sweep, a resumed run) is read back instead of compiled again. Cached
executables are the compiled ones, so results are unchanged.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
from absl import logging

DEFAULT_DIRECTORY = os.path.join('~', '.cache', 'fedjax_het', 'xla')


def configured_directory() -> Optional[str]:
  """The persistent cache directory JAX uses already (set by JAX_COMPILATION_CACHE_DIR, a test harness or a
  notebook), or None."""
  return jax.config.jax_compilation_cache_dir or None


def use_compilation_cache(directory: Optional[str]) -> Optional[str]:
  """Points XLA's persistent compilation cache at `directory` (created if missing; None or '' leaves it off)
  unless a cache directory is configured already, which is then kept; a folder that cannot be created is reported
  with a warning and the cache left off. Returns the directory in use, or None."""
  current = configured_directory()
  if current or not directory:
    return current
  directory = os.path.expanduser(directory)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:  # a read-only home, a file in the way: run without the cache rather than not at all
    logging.warning('--compilation_cache=%s cannot be created (%s); running without the compilation cache. Fix: '
                    'give a writable folder, or --compilation_cache= to turn it off.', directory, e)
    return None
  jax.config.update('jax_compilation_cache_dir', directory)
  # Every program, however quick to compile: a round is dozens of small ones (per group, phase and chunk width),
  # each under JAX's default threshold of one second, which together make most of a start.
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  return directory
