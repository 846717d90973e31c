"""Math shared by methods: masked means, class prototypes, (soft-label) cross-entropy, FedAvg."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_het.engine.forward import forward


def masked_mean(values: jnp.ndarray, mask: jnp.ndarray, axis: int = 0) -> jnp.ndarray:
  """Mean of `values` over `axis` counting only rows where `mask` is nonzero (0 where the mask is empty)."""
  m = mask.astype(values.dtype).reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
  return jnp.sum(values * m, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1e-12)


def class_prototypes(reps: jnp.ndarray, labels: jnp.ndarray, valid: jnp.ndarray, num_classes: int
                     ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Per-class means of reps [n, d] over valid rows: (prototypes [C, d] (0 for absent classes), counts [C])."""
  onehot = jax.nn.one_hot(labels, num_classes, dtype=reps.dtype) * valid[:, None].astype(reps.dtype)
  counts = onehot.sum(0)
  return (onehot.T @ reps) / jnp.maximum(counts, 1.0)[:, None], counts


def soft_cross_entropy(logits: jnp.ndarray, soft_labels: jnp.ndarray) -> jnp.ndarray:
  """Per-row -sum_c y_c log softmax(z)_c (FedRE Eq. 3 with entangled labels)."""
  return -jnp.sum(soft_labels * jax.nn.log_softmax(logits, axis=-1), axis=-1)


def cross_entropy_loss(model, params: Any, model_state: Any, x: jnp.ndarray, y: jnp.ndarray, broadcast: Any,
                       rng: jax.Array) -> tuple[jnp.ndarray, Any]:
  """Mean CE of the local model on a batch (FedRE Eq. 1); BatchNorm statistics update."""
  logits, _, model_state = forward(model, params, model_state, x, train=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), model_state


def weighted_average(tree: Any, weights: jnp.ndarray) -> Any:
  """sum_k w_k tree_k / sum_k w_k over the leading client axis of every leaf."""
  w = weights / jnp.maximum(weights.sum(), 1e-12)
  return jax.tree.map(lambda a: jnp.tensordot(w.astype(a.dtype), a, axes=1), tree)
