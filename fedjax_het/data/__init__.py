"""Datasets, client partitions and padded per-group client arrays."""
from fedjax_het.data.datasets import Dataset, load_dataset, load_digits, load_mnist5k, load_npz, load_tfds, make_synthetic
from fedjax_het.data.federated import ClientArrays, FederatedData, PublicData, make_federated_data, stack_clients
from fedjax_het.data.partition import (ClientSplit, dirichlet_partition, iid_partition, partition_clients,
                                       pathological_partition, train_test_split)
