"""Model application shared by training, representation passes and evaluation."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from fedjax_het.models.classifier import HeteroClassifier


def forward(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, train: bool
            ) -> tuple[jnp.ndarray, jnp.ndarray, Any]:
  """(logits, representation, new model_state) of the model; BatchNorm statistics update only when `train`."""
  variables = {'params': params, **model_state}
  if train and model_state:
    (logits, rep), updated = model.apply(variables, x, train=True, mutable=list(model_state))
    return logits, rep, dict(updated)
  logits, rep = model.apply(variables, x, train=train)
  return logits, rep, model_state
