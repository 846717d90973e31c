"""Model application shared by training, representation passes and evaluation."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from fedjax_het.models.classifier import HeteroClassifier


def forward(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, train: bool,
            method: Optional[Callable] = None) -> tuple[jnp.ndarray, jnp.ndarray, Any]:
  """(logits, representation, new model_state) of the model, or of `method` (e.g.
  `HeteroClassifier.companion_forward`); BatchNorm statistics update only when `train`."""
  variables = {'params': params, **model_state}
  if train and model_state:
    (logits, rep), updated = model.apply(variables, x, train=True, mutable=list(model_state), method=method)
    return logits, rep, dict(updated)
  logits, rep = model.apply(variables, x, train=train, method=method)
  return logits, rep, model_state


def head_logits(model: HeteroClassifier, head_params: Any, rep: jnp.ndarray) -> jnp.ndarray:
  """Logits of representations under a given head (e.g. the broadcast global head)."""
  return model.apply({'params': {'head': head_params}}, rep, method=HeteroClassifier.classify)


def represent_rows(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, chunk: int
                   ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Eval-mode (logits, representations) of all rows of one client's x [n_max, ...], `chunk` rows at a time.

  Pure and vmappable; n_max is padded up to a multiple of `chunk` internally and cut back after.
  """
  n_max = x.shape[0]
  chunk = max(1, min(chunk, n_max))
  pad = (-n_max) % chunk
  xp = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  chunks = xp.reshape((-1, chunk) + x.shape[1:])
  logits, reps = jax.lax.map(lambda xc: forward(model, params, model_state, xc, False)[:2], chunks)
  return logits.reshape(-1, logits.shape[-1])[:n_max], reps.reshape(-1, reps.shape[-1])[:n_max]
