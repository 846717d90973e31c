"""Client partitions of a labelled pool, following HtFLlib/PFLlib's `separate_data` and `split_data`.

- `dirichlet` (PRA): per class, Dirichlet(alpha) proportions over clients; a client already holding >= N/K samples
  gets proportion 0 for later classes; the whole draw is repeated until every client has >= least_samples.
- `pathological` (PAT): each client holds `classes_per_client` classes; class c is spread over the first
  ceil(K/C * classes_per_client) clients that still have class slots (a sliding window over clients), in equal
  shares (balanced) or random shares.
- `iid`: HtFLlib's IID is PAT with every class on every client, balanced.
- long tail (FedRE Table 3): before partitioning, keep n_c = n_max * IF^(-c / (C - 1)) samples of class c
  (imbalance factor IF), then partition what is left.

Randomness is the reference's, draw for draw: numpy's legacy MT19937 stream seeded once (`np.random.seed(seed)`
there, one `np.random.RandomState(seed)` here, which is the same stream without touching numpy's global state),
consumed in the reference's order (per class a shuffle then a Dirichlet draw; PAT one randint per class), then
each client's 75/25 split by scikit-learn's own `train_test_split(train_size=0.75, shuffle=True)` continuing the
same stream client by client. Index lists keep the order the split returns, so a client's rows are stored in the
reference's order (HtFLlib trains on them in that order). For the same seed the partition equals HtFLlib's and
PFLlib's (tested against `tests/fixtures/htfllib_partitions.json`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from fedjax_het.errors import ConfigError

PARTITIONS = ('dirichlet', 'pathological', 'iid')


@dataclasses.dataclass(frozen=True)
class ClientSplit:
  """Per-client sample indices into the pool, and each client's class counts [K, C] for train and test."""
  train_indices: list[np.ndarray]
  test_indices: list[np.ndarray]
  train_class_counts: np.ndarray
  test_class_counts: np.ndarray

  @property
  def num_clients(self) -> int:
    return len(self.train_indices)


def default_least_samples(num_samples: int, num_clients: int, batch_size: int = 10,
                          train_fraction: float = 0.75) -> int:
  """HtFLlib's minimum client size: min(batch_size / (1 - train_fraction), N / K / 2), i.e. min(40, N/2K)."""
  return int(min(batch_size / (1 - train_fraction), num_samples / num_clients / 2))


def class_counts(labels: np.ndarray, index_lists: list[np.ndarray], num_classes: int) -> np.ndarray:
  """[K, C] matrix: how many samples of each class each client holds."""
  return np.stack([np.bincount(labels[idx], minlength=num_classes) for idx in index_lists]).astype(np.int64)


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.RandomState,
                        num_classes: Optional[int] = None, least_samples: Optional[int] = None,
                        max_tries: int = 1000) -> list[np.ndarray]:
  """PRA partition (HtFLlib `separate_data(partition='dir')`): Dirichlet(alpha) per class with the N/K cap."""
  if not alpha > 0 or not np.isfinite(alpha):  # also NaN
    raise ConfigError(f'--alpha={alpha}: the Dirichlet concentration must be a finite number > 0 (the papers '
                      f'use 0.1).')
  labels = np.asarray(labels)
  n = len(labels)
  num_classes = num_classes or int(labels.max()) + 1
  if least_samples is None:
    least_samples = default_least_samples(n, num_clients)
  if num_clients * max(least_samples, 1) > n:
    raise ConfigError(f'--num_clients={num_clients}: {n} samples cannot give every client {max(least_samples, 1)} '
                      f'samples. Fix: lower --num_clients or use a larger dataset.')
  for _ in range(max_tries):
    batches = [[] for _ in range(num_clients)]
    for c in range(num_classes):
      idx_c = np.flatnonzero(labels == c)
      rng.shuffle(idx_c)
      p = rng.dirichlet(np.full(num_clients, alpha))
      p = p * np.array([len(b) < n / num_clients for b in batches])
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx_c)).astype(int)[:-1]
      for b, part in zip(batches, np.split(idx_c, cuts)):
        b.extend(part.tolist())
    if min(len(b) for b in batches) >= least_samples:
      return [np.asarray(b, dtype=np.int64) for b in batches]
  raise ConfigError(f'--partition=dirichlet: after {max_tries} draws some client still had fewer than '
                    f'{least_samples} samples (alpha={alpha}, num_clients={num_clients}, N={n}). Fix: raise --alpha '
                    f'or lower --num_clients.')


def pathological_partition(labels: np.ndarray, num_clients: int, classes_per_client: int,
                           rng: np.random.RandomState, num_classes: Optional[int] = None, balance: bool = False,
                           least_samples: Optional[int] = None) -> list[np.ndarray]:
  """PAT partition (HtFLlib `separate_data(partition='pat')`): `classes_per_client` classes per client."""
  labels = np.asarray(labels)
  num_classes = num_classes or int(labels.max()) + 1
  if not 1 <= classes_per_client <= num_classes:
    raise ConfigError(f'--classes_per_client={classes_per_client} must be between 1 and the number of classes '
                      f'({num_classes}).')
  if least_samples is None:
    least_samples = default_least_samples(len(labels), num_clients)
  slots = [classes_per_client] * num_clients
  chosen: list[list[int]] = [[] for _ in range(num_clients)]
  window = int(math.ceil(num_clients / num_classes * classes_per_client))
  for c in range(num_classes):
    idx_c = np.flatnonzero(labels == c)
    clients = [k for k in range(num_clients) if slots[k] > 0][:window]
    if not clients:
      continue
    share = len(idx_c) / len(clients)
    if balance:
      sizes = [int(share)] * (len(clients) - 1)
    else:
      low = max(share / 10, least_samples / num_classes)
      if low >= share:
        raise ConfigError(f'--partition=pathological: class {c} has {len(idx_c)} samples for {len(clients)} clients, '
                          f'too few for unbalanced shares. Fix: --balance, fewer --num_clients, or more data.')
      # randint truncates its float bounds as the reference's np.random.randint(max(...), num_per, n) does.
      sizes = rng.randint(low, share, len(clients) - 1).tolist()
    sizes.append(len(idx_c) - sum(sizes))
    start = 0
    for k, size in zip(clients, sizes):
      chosen[k].extend(idx_c[start:start + size].tolist())
      start += size
      slots[k] -= 1
  return [np.asarray(b, dtype=np.int64) for b in chosen]


def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.RandomState,
                  num_classes: Optional[int] = None) -> list[np.ndarray]:
  """HtFLlib's IID: every class split in equal shares over all clients (PAT with all classes, balanced)."""
  num_classes = num_classes or int(np.asarray(labels).max()) + 1
  return pathological_partition(labels, num_clients, num_classes, rng, num_classes, balance=True)


def train_test_split(index_lists: list[np.ndarray], train_fraction: float, rng: np.random.RandomState
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each client's indices split train/test by sklearn's `train_test_split(train_size=train_fraction,
  shuffle=True)` drawing from `rng`: a permutation, the first ceil(n (1 - f)) entries test, the rest train,
  both in permuted order (not stratified, as in HtFLlib). train_fraction 1 keeps every index for training, in
  stored order, and draws nothing."""
  if not 0 < train_fraction <= 1:
    raise ConfigError(f'--train_fraction={train_fraction} must be in (0, 1].')
  if train_fraction == 1:
    return [np.asarray(idx, np.int64) for idx in index_lists], [np.zeros(0, np.int64) for _ in index_lists]
  from sklearn.model_selection import train_test_split as sk_split
  train, test = [], []
  for idx in index_lists:
    if len(idx) < 2:
      raise ConfigError(f'--train_fraction={train_fraction}: a client holds {len(idx)} sample(s), too few to split '
                        f'into train and test. Fix: fewer --num_clients or a larger dataset.')
    tr, te = sk_split(np.asarray(idx, np.int64), train_size=train_fraction, shuffle=True, random_state=rng)
    train.append(tr)
    test.append(te)
  return train, test


def long_tail_indices(labels: np.ndarray, num_classes: int, imbalance_factor: float, rng: np.random.RandomState
                      ) -> np.ndarray:
  """Sorted indices of a long-tailed subset: n_c = floor(n_max * IF^(-c/(C-1))) random samples of class c."""
  if imbalance_factor < 1:
    raise ConfigError(f'--imbalance_factor={imbalance_factor} must be >= 1 (1 keeps every sample).')
  per_class = [np.flatnonzero(labels == c) for c in range(num_classes)]
  n_max = max(len(p) for p in per_class)
  keep = []
  for c, idx in enumerate(per_class):
    n_c = int(n_max * imbalance_factor ** (-c / max(num_classes - 1, 1)))
    keep.append(rng.choice(idx, min(n_c, len(idx)), replace=False))
  return np.sort(np.concatenate(keep))


def partition_clients(labels: np.ndarray, num_clients: int, partition: str, seed: int, num_classes: int,
                      alpha: float = 0.1, classes_per_client: int = 2, balance: bool = False,
                      train_fraction: float = 0.75, imbalance_factor: float = 1.0) -> ClientSplit:
  """Partitions a pool over clients and splits each client's share into local train/test, from one seed."""
  labels = np.asarray(labels)
  if num_clients < 1:
    raise ConfigError(f'--num_clients={num_clients} must be >= 1.')
  if num_clients > len(labels):
    raise ConfigError(f'--num_clients={num_clients} is more than the {len(labels)} samples to partition, so some '
                      f'client would hold none. Fix: --num_clients <= {len(labels)} (HtFLlib-style partitions '
                      f'need tens of samples per client), or a larger dataset.')
  present = np.unique(labels)
  if len(present) < 2:
    raise ConfigError(f'the dataset\'s samples all belong to class {present.tolist()}; classification needs at '
                      f'least two classes. Fix: check the labels of --dataset.')
  if not 0 <= seed < 2 ** 32:
    raise ConfigError(f'--seed={seed} must be in [0, 2**32).')
  rng = np.random.RandomState(seed)
  pool = np.arange(len(labels))
  if imbalance_factor != 1:
    pool = long_tail_indices(labels, num_classes, imbalance_factor, rng)
  if partition == 'dirichlet':
    parts = dirichlet_partition(labels[pool], num_clients, alpha, rng, num_classes)
  elif partition == 'pathological':
    parts = pathological_partition(labels[pool], num_clients, classes_per_client, rng, num_classes, balance)
  elif partition == 'iid':
    parts = iid_partition(labels[pool], num_clients, rng, num_classes)
  else:
    raise ConfigError(f'--partition={partition!r} is unknown; choose one of {", ".join(PARTITIONS)}.')
  parts = [pool[p] for p in parts]
  empty = [k for k, p in enumerate(parts) if len(p) == 0]
  if empty:
    fix = {'dirichlet': 'raise --alpha', 'pathological': 'raise --classes_per_client'}.get(partition, '')
    raise ConfigError(f'--partition={partition}: clients {empty[:10]} received no samples. Fix: lower '
                      f'--num_clients{" or " + fix if fix else ""}.')
  train, test = train_test_split(parts, train_fraction, rng)
  return ClientSplit(train, test, class_counts(labels, train, num_classes), class_counts(labels, test, num_classes))
