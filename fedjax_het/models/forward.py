"""Model application shared by training, representation passes and evaluation.

With a classifier of precision 'bfloat16' the parameters, inputs and BatchNorm statistics are cast to bfloat16
for the computation and its outputs back to float32: the parameters stay float32 (the master copy the optimizer
updates, their gradients flowing back through the casts), and so do the statistics kept between steps."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.norm import batch_rows


def forward(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, train: bool,
            mask: Optional[jnp.ndarray] = None) -> tuple[jnp.ndarray, jnp.ndarray, Any]:
  """(logits, representation, new model_state) of the model; BatchNorm statistics update only when `train`, and
  count only the rows where mask [B] is True when one is given (a padded partial batch, `Batch.mask`)."""
  compute = jnp.bfloat16 if getattr(model, 'precision', 'float32') == 'bfloat16' else None
  variables = {'params': _cast(params, compute), **_cast(model_state, compute)}
  x = _cast(x, compute)
  if train and model_state:
    with batch_rows(mask):
      (logits, rep), updated = model.apply(variables, x, train=True, mutable=list(model_state))
    restored = jax.tree.map(lambda new, old: new.astype(old.dtype), dict(updated), dict(model_state))
    return _float32(logits, compute), _float32(rep, compute), restored
  logits, rep = model.apply(variables, x, train=train)
  return _float32(logits, compute), _float32(rep, compute), model_state


def _cast(tree: Any, dtype) -> Any:
  """The floating-point leaves of `tree` as `dtype` (as they are when dtype is None)."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _float32(a: jnp.ndarray, compute) -> jnp.ndarray:
  return a if compute is None else a.astype(jnp.float32)
