"""FINCH clustering (Sarfraz et al., CVPR 2019) with cosine distance, in fixed shapes so that it jits and vmaps:
the server step of FPL, run on each class's client prototypes.

Rows are points; `valid` marks the real ones (the rest are padding and are never clustered). A partition is
given as labels [K]: each point's cluster is named by its representative, the smallest row index in it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_het.methods.shared.common import class_prototypes, cosine_similarity


def first_neighbor_partition(points: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
  """FINCH's clustering equation (its Eq. 1): i and j are linked when j is i's first (cosine) neighbour, i is
  j's, or both have the same first neighbour; clusters are the connected components. Returns labels [K]
  (padding rows label themselves)."""
  k = points.shape[0]
  distance = 1.0 - cosine_similarity(points, points)
  eye = jnp.eye(k, dtype=bool)
  distance = jnp.where(eye | ~valid[None, :], jnp.inf, distance)
  has_other = valid.sum() > 1
  neighbor = jnp.argmin(distance, axis=1)
  adjacency = eye | (jax.nn.one_hot(neighbor, k, dtype=bool) & (valid[:, None] & has_other))
  linked = (adjacency.astype(jnp.float32) @ adjacency.T.astype(jnp.float32)) > 0
  linked = linked & valid[:, None] & valid[None, :] | eye
  for _ in range(max(1, math.ceil(math.log2(k)))):  # transitive closure by repeated squaring
    linked = linked | ((linked.astype(jnp.float32) @ linked.astype(jnp.float32)) > 0)
  return jnp.argmax(linked, axis=1)  # the first (smallest) index each row reaches


def cluster_means(points: jnp.ndarray, labels: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
  """[K, d]: at each representative's row, the mean of its cluster's valid points (0 elsewhere)."""
  return class_prototypes(points, labels, valid, points.shape[0])[0]


def finch(points: jnp.ndarray, valid: jnp.ndarray) -> jnp.ndarray:
  """FINCH's last partition (the coarsest with more than one cluster, or the first one if that already has a
  single cluster), as RethinkFL's FPL takes it (`c[:, -1]`, ensure_early_exit=False). Returns labels [K].

  Each level clusters the previous level's cluster means by `first_neighbor_partition`; the recursion stops
  before a level that leaves one cluster or merges nothing. Every accepted level at least halves the clusters,
  so ceil(log2 K) levels suffice.
  """
  k = points.shape[0]
  labels = first_neighbor_partition(points, valid)
  count = lambda lab: jnp.sum(valid & (lab == jnp.arange(k)))
  done = jnp.asarray(False)
  for _ in range(max(1, math.ceil(math.log2(max(k, 2))))):
    means = cluster_means(points, labels, valid)
    is_rep = valid & (labels == jnp.arange(k))
    merged = first_neighbor_partition(means, is_rep)[labels]
    stop = done | (count(merged) <= 1) | (count(merged) >= count(labels))
    labels = jnp.where(stop, labels, merged)
    done = stop
  return labels
