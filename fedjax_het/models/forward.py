"""Model application shared by training, representation passes and evaluation."""

from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp

from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.norm import batch_rows


def forward(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, train: bool,
            mask: Optional[jnp.ndarray] = None) -> tuple[jnp.ndarray, jnp.ndarray, Any]:
  """(logits, representation, new model_state) of the model; BatchNorm statistics update only when `train`, and
  count only the rows where mask [B] is True when one is given (a padded partial batch, `Batch.mask`)."""
  variables = {'params': params, **model_state}
  if train and model_state:
    with batch_rows(mask):
      (logits, rep), updated = model.apply(variables, x, train=True, mutable=list(model_state))
    return logits, rep, dict(updated)
  logits, rep = model.apply(variables, x, train=train)
  return logits, rep, model_state
