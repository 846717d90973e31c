"""What a round costs and what it scores: communication measured from the uploads and broadcasts that cross
(scalars and fp32 bytes, per part), local work, and the accuracy metrics of an evaluation."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

BYTES_PER_SCALAR = 4  # fp32


def count_uploads(upload_scalars: Callable[[Any], dict], uploads: Any, mask: jnp.ndarray) -> dict:
  """{part: scalars} summed over the slots in `mask` of uploads stacked over slots (pure, jittable)."""
  per_slot = jax.vmap(lambda u: {k: jnp.asarray(v, jnp.float32) for k, v in upload_scalars(u).items()},
                      axis_size=mask.shape[0])(uploads)
  return {k: jnp.sum(jnp.where(mask, v, 0.0)) for k, v in per_slot.items()}


def communication_metrics(upload_parts: Sequence[dict], broadcast_parts: Sequence[tuple[dict, int]]) -> dict:
  """Round metrics from per-group {part: scalars}: upload_scalars, upload_bytes, upload_<part>_scalars, and the
  same for the broadcast (each group's broadcast once per participant of the group)."""
  out = {}
  for direction, groups in (('upload', [(parts, 1) for parts in upload_parts]), ('broadcast', broadcast_parts)):
    total: dict = {}
    for parts, times in groups:
      for part, v in parts.items():
        total[part] = total.get(part, 0) + float(v) * times
    scalars = sum(total.values())
    out[f'{direction}_scalars'] = int(round(scalars))
    out[f'{direction}_bytes'] = int(round(scalars)) * BYTES_PER_SCALAR
    out.update({f'{direction}_{part}_scalars': int(round(v)) for part, v in total.items()})
  return out


def accuracy_metrics(names: Sequence[str], correct: np.ndarray, counts: np.ndarray, prefix: str,
                     per_client: bool) -> dict:
  """Per prediction (correct [clients, names]): the sample-weighted accuracy sum(correct)/sum(n) over all clients
  (HtFLlib's metric), the mean and std over clients with test rows, and, for the first (the reported one, its
  metrics unprefixed by its name) the per-client accuracies when `per_client`."""
  out = {}
  has_data = counts > 0
  for j, name in enumerate(names):
    c = correct[:, j].astype(np.float64)
    per = c[has_data] / counts[has_data]
    head = prefix if j == 0 else f'{prefix}{name}_'
    out[f'{head}accuracy'] = float(c.sum() / max(counts.sum(), 1))
    out[f'{head}client_accuracy_mean'] = float(per.mean())
    out[f'{head}client_accuracy_std'] = float(per.std())
    if j == 0 and per_client:
      out['eval_head'] = name
      out['client_accuracy'] = [float(a) for a in c / np.maximum(counts, 1)]
  return out
