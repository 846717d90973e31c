"""Pytrees as Flower `ArrayRecord`s: one array per leaf, named by its position in the tree; read back into the
structure of a template (the receiver builds the same structures from the same config, so only arrays cross)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flwr.app import Array, ArrayRecord

from fedjax_het.errors import ConfigError


def tree_to_record(tree: Any) -> ArrayRecord:
  """The leaves of `tree` as an ArrayRecord {'00000': leaf 0, ...} (host NumPy copies)."""
  return ArrayRecord({f'{i:05d}': Array(np.asarray(leaf)) for i, leaf in enumerate(jax.tree.leaves(tree))})


def tree_from_record(record: ArrayRecord, template: Any, what: str) -> Any:
  """The pytree of `template`'s structure whose leaves are `record`'s arrays; a ConfigError naming `what` when the
  arrays do not fit (the two sides run different configs or versions)."""
  leaves, treedef = jax.tree.flatten(template)
  arrays = [record[f'{i:05d}'].numpy() if f'{i:05d}' in record else None for i in range(len(leaves))]
  for i, (a, leaf) in enumerate(zip(arrays, leaves)):
    if a is None or a.shape != np.shape(leaf) or a.dtype != np.dtype(leaf.dtype):
      got = 'nothing' if a is None else f'{a.dtype}{list(a.shape)}'
      raise ConfigError(f'{what}: leaf {i} is {got}, expected {np.dtype(leaf.dtype)}{list(np.shape(leaf))} (and '
                        f'{len(record)} arrays for {len(leaves)} leaves). Fix: run the server and every node with '
                        f'the same flags and fedjax_het version.')
  return jax.tree.unflatten(treedef, arrays)
