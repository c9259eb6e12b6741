"""A run's clients over its data: each client's training and local test examples, and where they live.

`federate(data, num_clients, method, ...)` splits a loaded `Dataset` (its own clients with
`method='natural'`, else pooled by `data.partition`) or takes a generated population's clients
(`data.synthetic`), and returns what the run layer needs of them, whichever the source:
`on_device()` (the population's `FederatedSplit`s), `on_host(process)` (this process's clients'
`ClientWindows`), `train_counts`, `data_bytes` (for the client store's choice), `global_test`
(the global evaluator's examples) and `summary()` (the run's partition.json).
"""

from __future__ import annotations

import dataclasses
import numpy as np

from fedjax_sparse.data.dataset import Dataset
from fedjax_sparse.data.federated import FederatedSplit, federated_split
from fedjax_sparse.data.mapped import MappedDataset
from fedjax_sparse.data.partition import NATURAL, local_test_split, natural_partition, partition, partition_summary
from fedjax_sparse.data.process_layout import ProcessLayout
from fedjax_sparse.data.synthetic import Synthetic
from fedjax_sparse.data.windows import ClientWindows, host_data


@dataclasses.dataclass(frozen=True)
class Federation:
    """Clients of a loaded `Dataset`: client k trains on `dataset.x_train[train_indices[k]]` and is
    scored on `dataset.x_test[test_indices[k]]`."""

    dataset: Dataset
    train_indices: list
    test_indices: list

    @property
    def client_indices(self) -> list:
        return self.train_indices

    @property
    def train_counts(self) -> np.ndarray:
        return np.array([len(ix) for ix in self.train_indices], np.int64)

    @property
    def data_bytes(self) -> int:
        """Bytes of the clients' training and test examples (examples and int32 labels)."""
        data = self.dataset
        example = int(np.prod(data.input_shape)) * data.x_train.itemsize + 4
        return example * (sum(len(ix) for ix in self.train_indices) + sum(len(ix) for ix in self.test_indices))

    @property
    def global_test(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dataset.x_test, self.dataset.y_test

    def on_device(self) -> tuple[FederatedSplit, FederatedSplit]:
        d = self.dataset
        return (federated_split(d.x_train, d.y_train, self.train_indices, d.mean, d.std, augment=d.augment),
                federated_split(d.x_test, d.y_test, self.test_indices, d.mean, d.std))

    def on_host(self, process: ProcessLayout) -> tuple[ClientWindows, ClientWindows]:
        d = self.dataset
        if isinstance(d, MappedDataset):  # the examples stay in their files until a round reads them
            return d.on_host(self.train_indices, self.test_indices, process)
        return (host_data(d.x_train, d.y_train, self.train_indices, d.mean, d.std, augment=d.augment,
                          process=process),
                host_data(d.x_test, d.y_test, self.test_indices, d.mean, d.std, process=process))

    def first_client(self) -> FederatedSplit:
        """Client 0's training examples alone (what a check on shapes needs)."""
        d, first = self.dataset, np.asarray(self.train_indices[0])
        return federated_split(d.x_train[first], d.y_train[first], [np.arange(len(first))], d.mean, d.std)

    def summary(self) -> list[dict]:
        return partition_summary(self.train_indices, self.dataset.y_train, self.dataset.num_classes)


@dataclasses.dataclass(frozen=True)
class GeneratedFederation:
    """The clients of a generated population (`data.synthetic.Synthetic`): client k is its client k."""

    population: Synthetic

    client_indices = None

    @property
    def train_counts(self) -> np.ndarray:
        return self.population.counts["train"]

    @property
    def data_bytes(self) -> int:
        p = self.population
        return int(p.sizes.sum()) * (int(np.prod(p.input_shape)) * 4 + 4)

    @property
    def global_test(self) -> tuple[np.ndarray, np.ndarray]:
        return self.population.global_test

    def on_device(self) -> tuple[FederatedSplit, FederatedSplit]:
        """Every client materialized, laid out as `federated_split` lays out a pooled data set's."""
        p, clients = self.population, np.arange(self.population.num_clients)
        splits = []
        for split in ("train", "test"):
            x, y = p.materialize(clients, split)
            bounds = np.concatenate([[0], np.cumsum(p.counts[split])])
            splits.append(federated_split(x, y, [np.arange(a, b) for a, b in zip(bounds, bounds[1:])], p.mean,
                                          p.std))
        return splits[0], splits[1]

    def on_host(self, process: ProcessLayout) -> tuple[ClientWindows, ClientWindows]:
        return self.population.windows("train", process), self.population.windows("test", process)

    def first_client(self) -> FederatedSplit:
        """Client 0's training examples alone (what a check on shapes needs)."""
        x, y = self.population.examples(0, "train")
        return federated_split(x, y, [np.arange(len(y))], self.population.mean, self.population.std)

    def summary(self) -> dict:
        """Compact for a population of millions: its spec and each client's training examples (its labels
        would cost generating every client)."""
        return {"generated": self.population.name, "num_clients": self.population.num_clients,
                "num_examples": self.train_counts.tolist()}


def federate(data: Dataset | Synthetic, num_clients: int, method: str, *, seed, test_seed, alpha: float | None = None,
             labels_per_client: int | None = None, min_examples: int = 2,
             local_test_ratio: float = 0.2) -> Federation | GeneratedFederation:
    """The run's `num_clients` clients (module docstring). `seed`: the partition's stream (which
    clients a natural partition takes, how pooled data are split); `test_seed`: the local test
    split's (a pooled partition's clients draw their test examples from the global test set with
    their own label mix, `local_test_split`; a natural client has its own)."""
    if isinstance(data, Synthetic):
        if method != NATURAL:
            raise ValueError(f"--partition {method}: the clients of {data.name} are generated, each with its own "
                             f"data; use --partition natural (the default for it)")
        if num_clients != data.num_clients:
            raise ValueError(f"{data.name} was generated for {data.num_clients} clients, not {num_clients}")
        return GeneratedFederation(data)
    if method == NATURAL:
        if not data.has_clients:
            raise ValueError(f"--partition natural needs a data set with its own clients (femnist, shakespeare, "
                             f"leaf:PATH, synthetic:A,B); {data.name} has none: use iid, dirichlet or labels")
        train, test = natural_partition(data.train_clients, data.test_clients, num_clients, seed, min_examples)
        return Federation(data, train, test)
    train = partition(data.y_train, num_clients, method, seed=seed, alpha=alpha, labels_per_client=labels_per_client,
                      min_examples=min_examples)
    test = local_test_split(train, data.y_train, data.y_test, data.num_classes, seed=test_seed, ratio=local_test_ratio)
    return Federation(data, train, test)
