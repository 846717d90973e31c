"""Per-client state. Stacked over a group, every leaf gets a leading client axis."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class ClientState(NamedTuple):
  """One client's model and its constant key.

  params: flax params {'extractor': ..., ['rm_fc': ...], 'head': ...}.
  model_state: non-trainable collections, e.g. {'batch_stats': ...}; {} for models without BatchNorm.
  key: a uint32[2] key fixed at initialisation (for draws that must not change across rounds, e.g. FedRE's
    fixed-sampling ablation).
  """
  params: Any
  model_state: Any
  key: jax.Array
