"""A federated dataset: per-client train/test splits, stacked into padded arrays per architecture group.

Inside a group, client data are arrays with a leading client axis, padded to the largest client:
x [clients, n_max, H, W, C], y [clients, n_max], n [clients]. Rows at positions >= n are padding and never
contribute to a loss, a prototype, an accuracy or a count.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import numpy as np

from fedjax_het.data.datasets import Dataset
from fedjax_het.data.partition import ClientSplit, partition_clients
from fedjax_het.errors import ConfigError

PROTOCOLS = ('pooled', 'global')


class ClientArrays(NamedTuple):
  """Padded client data; every leaf has a leading client axis when stacked for a group."""
  x: np.ndarray  # [clients, n_max, H, W, C]
  y: np.ndarray  # [clients, n_max] int32; padding rows hold 0
  n: np.ndarray  # [clients] int32, number of real rows


def stack_clients(x: np.ndarray, y: np.ndarray, index_lists: Sequence[np.ndarray],
                  pad_to: Optional[int] = None) -> ClientArrays:
  """Gathers each client's rows from the pool and pads them to a common length (at least 1 row)."""
  sizes = np.array([len(i) for i in index_lists], dtype=np.int32)
  n_max = max(int(sizes.max(initial=0)), pad_to or 0, 1)
  xs = np.zeros((len(index_lists), n_max) + x.shape[1:], dtype=x.dtype)
  ys = np.zeros((len(index_lists), n_max), dtype=np.int32)
  for k, idx in enumerate(index_lists):
    xs[k, :len(idx)] = x[idx]
    ys[k, :len(idx)] = y[idx]
  return ClientArrays(xs, ys, sizes)


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """The pool, the client split over it, and (global-test protocol) a held-out test set for every client."""
  dataset: Dataset
  split: ClientSplit
  protocol: str

  @property
  def num_clients(self) -> int:
    return self.split.num_clients

  @property
  def num_classes(self) -> int:
    return self.dataset.num_classes

  def group_train(self, clients: Sequence[int]) -> ClientArrays:
    """Stacked local training data of the given clients."""
    return stack_clients(self.dataset.x, self.dataset.y, [self.split.train_indices[k] for k in clients])

  def group_test(self, clients: Sequence[int]) -> ClientArrays:
    """Stacked local test data of the given clients (pooled protocol)."""
    return stack_clients(self.dataset.x, self.dataset.y, [self.split.test_indices[k] for k in clients])

  def loader_label_counts(self, batch_size: int, drop_last_rows: bool = True) -> np.ndarray:
    """[C] label counts summed over every client's training rows that its train loader yields: the first
    B*floor(n/B) rows in stored order when `drop_last_rows` (HtFLlib's DataLoader(shuffle=False,
    drop_last=True)), all rows otherwise. FedGen's label distribution (HtFLlib counts it this way, once, over all
    clients)."""
    counts = np.zeros(self.num_classes, np.int64)
    for idx in self.split.train_indices:
      used = idx[:len(idx) // batch_size * batch_size] if drop_last_rows else idx
      counts += np.bincount(self.dataset.y[used], minlength=self.num_classes)
    return counts

  def global_test(self) -> Optional[ClientArrays]:
    """The dataset's global test set as one pseudo-client (global protocol), else None."""
    if self.protocol != 'global' or self.dataset.x_test is None:
      return None
    return stack_clients(self.dataset.x_test, self.dataset.y_test, [np.arange(len(self.dataset.y_test))])


def make_federated_data(dataset: Dataset, num_clients: int, partition: str, seed: int, protocol: str = 'pooled',
                        alpha: float = 0.1, classes_per_client: int = 2, balance: bool = False,
                        train_fraction: Optional[float] = None, imbalance_factor: float = 1.0) -> FederatedData:
  """Builds the client split for an evaluation protocol.

  - 'pooled' (HtFLlib, FedRE): merge train+test, partition the pool, split each client 75/25 into local
    train/test; accuracy is measured on the local test splits.
  - 'global' (FedVTC, GeFL): partition the training split only; clients train on all of it
    (train_fraction 1 unless set) and are scored on the dataset's global test set.
  """
  if protocol not in PROTOCOLS:
    raise ConfigError(f'--eval_protocol={protocol!r} is unknown; choose one of {", ".join(PROTOCOLS)}.')
  if protocol == 'pooled':
    dataset = dataset.pooled()
    train_fraction = 0.75 if train_fraction is None else train_fraction
  else:
    if dataset.x_test is None:
      raise ConfigError(f'--eval_protocol=global needs a dataset with a test split; {dataset.name} has none. '
                        f'Fix: use --eval_protocol=pooled or supply x_test/y_test in the .npz.')
    train_fraction = 1.0 if train_fraction is None else train_fraction
  split = partition_clients(dataset.y, num_clients, partition, seed, dataset.num_classes, alpha=alpha,
                            classes_per_client=classes_per_client, balance=balance, train_fraction=train_fraction,
                            imbalance_factor=imbalance_factor)
  return FederatedData(dataset, split, protocol)
