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


class FlatRows(NamedTuple):
  """Clients' rows without padding: client i's are x[offset[i]:offset[i] + n[i]] (host arrays)."""
  x: np.ndarray       # [N, H, W, C]
  y: np.ndarray       # [N] int32
  offset: np.ndarray  # [clients] int64
  n: np.ndarray       # [clients] int32


def flat_clients(x: np.ndarray, y: np.ndarray, index_lists: Sequence[np.ndarray]) -> FlatRows:
  """Gathers each client's rows from the pool, one after another (at least one row in all, so that every array
  has a row to read)."""
  sizes = np.array([len(i) for i in index_lists], dtype=np.int32)
  offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)
  idx = np.concatenate([np.asarray(i, np.int64) for i in index_lists]) if len(index_lists) else np.zeros(0, np.int64)
  if not len(idx):
    return FlatRows(np.zeros((1,) + x.shape[1:], x.dtype), np.zeros(1, np.int32), offset, sizes)
  return FlatRows(x[idx], y[idx].astype(np.int32), offset, sizes)


class PublicData(NamedTuple):
  """The server's public dataset (FedMD, FedDF): images x [P, H, W, C], labels y [P] (FedMD's transfer learning
  reads them; FedDF's distillation does not) and where it comes from ('held out of mnist', 'svhn_cropped');
  validation_x, validation_y: labelled rows held out of the training rows for the server's own validation (FedDF's
  early stopping, its code's val_data_ratio split), or None."""
  x: np.ndarray
  y: np.ndarray
  source: str
  validation_x: Optional[np.ndarray] = None
  validation_y: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """The pool, the client split over it, (global-test protocol) a held-out test set for every client and, for
  methods that distil on public data, the server's public dataset (None: none)."""
  dataset: Dataset
  split: ClientSplit
  protocol: str
  public: Optional[PublicData] = None

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

  def group_rows(self, clients: Sequence[int], which: str = 'train') -> FlatRows:
    """The given clients' local training (or, which='test', test) rows, unpadded (`FlatRows`)."""
    lists = self.split.train_indices if which == 'train' else self.split.test_indices
    return flat_clients(self.dataset.x, self.dataset.y, [lists[k] for k in clients])

  def global_test_rows(self) -> Optional[FlatRows]:
    """The global test set as the rows of one pseudo-client (global protocol), else None."""
    if self.protocol != 'global' or self.dataset.x_test is None:
      return None
    return flat_clients(self.dataset.x_test, self.dataset.y_test, [np.arange(len(self.dataset.y_test))])

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


def hold_out_public(dataset: Dataset, size: int, seed: int, what: str = 'public_size', salt: int = 7919
                    ) -> tuple[Dataset, PublicData]:
  """(the dataset without them, PublicData): `size` rows drawn at random (seeded) from the training rows, held out
  of every client's data as the server's public set (Felo's FedMD: 10 % of CIFAR-10's training images)."""
  if not 0 < size < len(dataset.y):
    raise ConfigError(f'make_federated_data.{what}={size} must be in (0, {len(dataset.y)}): these rows '
                      f'are held out of the {len(dataset.y)} training rows of {dataset.name}.')
    # (an unreachable size of 0 is no public data, handled by the caller)
  order = np.random.RandomState(seed + salt).permutation(len(dataset.y))
  public, kept = np.sort(order[:size]), np.sort(order[size:])
  rest = dataclasses.replace(dataset, x=dataset.x[kept], y=dataset.y[kept])
  return rest, PublicData(dataset.x[public], dataset.y[public], f'{size} rows held out of {dataset.name}')


def public_from(other: Dataset, size: int, seed: int) -> PublicData:
  """Another dataset's training images as the public set (FedDF's SVHN for MNIST): `size` of them drawn at random
  (seeded), or all when size is 0; the images must already match the clients' shape (`Dataset.matching`)."""
  if size < 0 or size > len(other.y):
    raise ConfigError(f'make_federated_data.public_size={size} must be in [0, {len(other.y)}] (0: every training '
                      f'image of the public dataset {other.name}).')
  rows = np.arange(len(other.y)) if size == 0 else np.sort(
      np.random.RandomState(seed + 7919).permutation(len(other.y))[:size])
  return PublicData(other.x[rows], other.y[rows], f'{len(rows)} rows of {other.name}')


def make_federated_data(dataset: Dataset, num_clients: int, partition: str, seed: int, protocol: str = 'pooled',
                        alpha: float = 0.1, classes_per_client: int = 2, balance: bool = False,
                        train_fraction: Optional[float] = None, imbalance_factor: float = 1.0,
                        public_size: int = 0, public_dataset: Optional[Dataset] = None,
                        validation_size: int = 0) -> FederatedData:
  """Builds the client split for an evaluation protocol.

  - 'pooled' (HtFLlib, FedRE): merge train+test, partition the pool, split each client 75/25 into local
    train/test; accuracy is measured on the local test splits.
  - 'global' (FedVTC, GeFL): partition the training split only; clients train on all of it
    (train_fraction 1 unless set) and are scored on the dataset's global test set.
  The server's public set: `public_dataset` (another dataset, `public_size` of its rows, 0 for all), or else
  `public_size` > 0 rows held out of the training rows (the pool under 'pooled') before they are partitioned.
  validation_size > 0: as many labelled rows held out of the training rows too, the server's validation set
  (`PublicData.validation_x`; FedDF's early stopping), which needs a public set.
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
  public = None
  if public_dataset is not None:
    public = public_from(public_dataset, public_size, seed)
  elif public_size:
    dataset, public = hold_out_public(dataset, public_size, seed)
  if validation_size:
    if public is None:
      raise ConfigError(f'make_federated_data.validation_size={validation_size}: the server\'s validation rows serve '
                        f'a method that distils on public data, and this run has none. Fix: a public set '
                        f'(make_federated_data.public_size or public_dataset), or validation_size=0.')
    dataset, held = hold_out_public(dataset, validation_size, seed, 'validation_size', salt=104729)
    public = public._replace(validation_x=held.x, validation_y=held.y)
  split = partition_clients(dataset.y, num_clients, partition, seed, dataset.num_classes, alpha=alpha,
                            classes_per_client=classes_per_client, balance=balance, train_fraction=train_fraction,
                            imbalance_factor=imbalance_factor)
  return FederatedData(dataset, split, protocol, public)
