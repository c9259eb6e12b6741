"""Splitting a labelled data set over federated clients.

Every partitioner returns one sorted int64 index array per client into the
labels it was given, and is a pure function of its arguments: the same seed
gives the same partition (numpy `Generator(PCG64(seed))`).

* `iid_partition`        uniform random split into near-equal parts.
* `dirichlet_partition`  per class, client proportions ~ Dir(alpha) (the
                         non-IID split used by SPATL and SpaFL).
* `label_partition`      each client holds exactly S labels (HeteroFL/FedGSE
                         "shards").
* `partition`            validated dispatch over the three.
* `natural_partition`    the data set's own clients (FEMNIST's writers, Shakespeare's
                         roles), each with its own test examples.

`local_test_split` draws each client's personal test set from the global test
set with the client's own label distribution; `stratified_holdout` picks the
share of one client's examples it holds out of training (SPATL's validation
data); `partition_summary` reports the per-client class counts for a run's
outputs.
"""

from __future__ import annotations

import math
import operator

import numpy as np

METHODS = ("iid", "dirichlet", "labels")
NATURAL = "natural"


def _as_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got dtype {labels.dtype} and shape {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"labels must be non-negative, got minimum {labels.min()}")
    return labels


def _check_num_clients(num_clients, num_examples: int) -> int:
    try:
        num_clients = operator.index(num_clients)
    except TypeError:
        raise ValueError(f"num_clients must be an integer, got {num_clients!r}") from None
    if num_clients < 1:
        raise ValueError(f"num_clients={num_clients} must be at least 1")
    if num_clients > num_examples:
        raise ValueError(f"num_clients={num_clients} exceeds the {num_examples} examples; use at most {num_examples} clients")
    return num_clients


def _finish(parts) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def iid_partition(labels, num_clients: int, seed: int) -> list[np.ndarray]:
    """A uniformly random split into `num_clients` parts whose sizes differ by at most one."""
    labels = _as_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def _dirichlet_draw(rng: np.random.Generator, labels: np.ndarray, num_clients: int, alpha: float) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        # Cut points from the cumulative proportions: client k gets
        # idx[cuts[k-1]:cuts[k]], so every example goes to exactly one client.
        cuts = np.floor(np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].append(piece)
    return [np.concatenate(p) for p in parts]


def dirichlet_partition(
    labels,
    num_clients: int,
    alpha: float,
    seed: int,
    min_examples: int = 2,
    max_redraws: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split: for each class, client shares ~ Dir(alpha) split that class's examples.

    Small alpha concentrates each class on few clients; large alpha approaches an
    IID split. (Unlike NIID-Bench's variant, no client is capped at N/num_clients
    examples, so client sizes vary as well.) If a client ends up with fewer than
    `min_examples` examples the whole split is redrawn from the same generator,
    at most `max_redraws` times; then a ValueError says what would help.
    """
    labels = _as_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    if alpha is None or not (float(alpha) > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha={alpha} must be a positive finite number for a dirichlet partition")
    if min_examples < 0 or max_redraws < 0:
        raise ValueError(f"min_examples={min_examples} and max_redraws={max_redraws} must be non-negative")
    hint = (
        f"dirichlet partition could not give each of num_clients={num_clients} clients at least "
        f"min_examples={min_examples} of the {len(labels)} examples with alpha={alpha}"
    )
    if num_clients * min_examples > len(labels):
        raise ValueError(f"{hint}: impossible, it needs {num_clients * min_examples} examples; use fewer clients or a smaller min_examples")
    rng = np.random.default_rng(seed)
    smallest = 0
    for _ in range(max_redraws + 1):
        parts = _dirichlet_draw(rng, labels, num_clients, alpha)
        smallest = min(len(p) for p in parts)
        if smallest >= min_examples:
            return _finish(parts)
    raise ValueError(
        f"{hint} in {max_redraws + 1} draws (smallest client got {smallest}); "
        "use a larger alpha, fewer clients or a smaller min_examples"
    )


def label_partition(labels, num_clients: int, labels_per_client: int, seed: int) -> list[np.ndarray]:
    """Each client holds exactly `labels_per_client` (S) distinct labels (HeteroFL/FedGSE shards).

    With C classes and a random permutation `perm` of them, client i holds
    `perm[(i * S + j) % C]` for j < S: S consecutive entries of the cycled
    permutation, hence distinct (S <= C), and every class is held by
    floor or ceil of num_clients * S / C clients. The clients holding a class
    split its (shuffled) examples into near-equal parts. Every class must be
    held by someone (num_clients * S >= C) and have at least as many examples
    as holders, otherwise a ValueError is raised, so all examples are used.
    """
    labels = _as_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    classes = np.unique(labels)
    num_classes = len(classes)
    try:
        s = operator.index(labels_per_client)
    except TypeError:
        raise ValueError(f"labels_per_client must be an integer, got {labels_per_client!r}") from None
    if not 1 <= s <= num_classes:
        raise ValueError(f"labels_per_client={labels_per_client} must be between 1 and the number of classes ({num_classes})")
    if num_clients * s < num_classes:
        raise ValueError(
            f"label partition with num_clients={num_clients} and labels_per_client={s} covers only "
            f"{num_clients * s} of {num_classes} classes; need num_clients * labels_per_client >= {num_classes}"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i in range(num_clients):
        for j in range(s):
            holders[perm[(i * s + j) % num_classes]].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(holders[k]):
            raise ValueError(
                f"label partition: class {c} has {len(idx)} examples but labels_per_client={s} with "
                f"num_clients={num_clients} gives it {len(holders[k])} holders; use fewer clients or labels_per_client"
            )
        for client, piece in zip(holders[k], np.array_split(idx, len(holders[k]))):
            parts[client].append(piece)
    return _finish(np.concatenate(p) for p in parts)


def partition(
    labels,
    num_clients: int,
    method: str,
    *,
    seed: int,
    alpha: float | None = None,
    labels_per_client: int | None = None,
    min_examples: int = 2,
) -> list[np.ndarray]:
    """Splits example indices over clients by `method` in {'iid', 'dirichlet', 'labels'}.

    'dirichlet' needs `alpha` > 0 (and uses `min_examples`); 'labels' needs
    1 <= `labels_per_client` <= number of classes. Arguments a method does not
    use are ignored.
    """
    labels = _as_labels(labels)
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; valid: {', '.join(METHODS)}")
    num_clients = _check_num_clients(num_clients, len(labels))
    if method == "iid":
        return iid_partition(labels, num_clients, seed)
    if method == "dirichlet":
        if alpha is None:
            raise ValueError("dirichlet partition needs alpha (a positive number, e.g. 0.1 for strong skew, 100 for near-IID)")
        return dirichlet_partition(labels, num_clients, alpha, seed, min_examples=min_examples)
    if labels_per_client is None:
        raise ValueError(f"labels partition needs labels_per_client between 1 and the number of classes ({len(np.unique(labels))})")
    return label_partition(labels, num_clients, labels_per_client, seed)


def natural_partition(train_clients, test_clients, num_clients: int, seed: int,
                      min_examples: int = 2) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The data set's own clients: (train indices, test indices) per client, each sorted int64.

    `train_clients`/`test_clients` name the client of every training/test example. A client
    takes part when it holds at least `min_examples` training examples and one test example
    (LEAF's per-user split gives every user of two or more examples one of each); of those,
    `num_clients` are drawn without replacement by `seed` (all of them when it equals their
    number), in ascending client order. More than there are is a one-line ValueError.
    """
    train_clients, test_clients = np.asarray(train_clients), np.asarray(test_clients)
    size = int(max(train_clients.max(initial=-1), test_clients.max(initial=-1))) + 1
    train_sizes = np.bincount(train_clients, minlength=size)
    test_sizes = np.bincount(test_clients, minlength=size)
    eligible = np.flatnonzero((train_sizes >= min_examples) & (test_sizes >= 1))
    try:
        num_clients = operator.index(num_clients)
    except TypeError:
        raise ValueError(f"num_clients must be an integer, got {num_clients!r}") from None
    if not 1 <= num_clients <= len(eligible):
        raise ValueError(f"num_clients={num_clients} exceeds the {len(eligible)} clients of the data set with at "
                         f"least min_examples={min_examples} training examples and one test example; use 1 to "
                         f"{len(eligible)} clients")
    chosen = eligible if num_clients == len(eligible) else np.sort(
        np.random.default_rng(seed).choice(eligible, num_clients, replace=False))

    def members(clients):
        order = np.argsort(clients, kind="stable")
        bounds = np.searchsorted(clients[order], np.stack([chosen, chosen + 1]))
        return [np.sort(order[a:b]).astype(np.int64) for a, b in zip(*bounds)]

    return members(train_clients), members(test_clients)


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers proportional to `weights` that sum to `total` (Hamilton's method)."""
    quotas = weights / weights.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    short = total - counts.sum()
    if short > 0:
        # Stable sort: ties go to the lower class index, keeping this deterministic.
        order = np.argsort(-(quotas - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def local_test_split(
    client_train_indices,
    train_labels,
    test_labels,
    num_classes: int,
    seed: int,
    ratio: float = 0.2,
    min_examples: int = 1,
) -> list[np.ndarray]:
    """Per client, a personal test set from the global test set with the client's label mix.

    Client k with n_k training examples gets max(min_examples, round(ratio * n_k))
    test examples (ratio 0.2 matches SPATL's 5k train / 1k local test per
    client), allocated over classes in proportion to its training class counts
    by the largest-remainder method, so only classes it trains on appear. Within
    a client, examples are drawn without replacement; each class's share is
    capped at what the global test set holds of it (the shortfall is not moved
    to other classes, which would distort the mix). Different clients draw
    independently and may share test examples. A client with no training data
    gets an empty test split. Returns sorted indices into `test_labels`.
    """
    train_labels = _as_labels(train_labels)
    test_labels = _as_labels(test_labels)
    if ratio < 0 or min_examples < 0:
        raise ValueError(f"ratio={ratio} and min_examples={min_examples} must be non-negative")
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    available = np.array([len(ix) for ix in by_class])
    splits = []
    for idx in client_train_indices:
        idx = np.asarray(idx, dtype=np.int64)
        counts = np.bincount(train_labels[idx], minlength=num_classes)
        if counts.sum() == 0:
            splits.append(np.zeros(0, dtype=np.int64))
            continue
        n_test = max(min_examples, int(round(ratio * len(idx))))
        alloc = np.minimum(_largest_remainder(counts.astype(np.float64), n_test), available)
        picks = [rng.choice(by_class[c], size=alloc[c], replace=False) for c in np.flatnonzero(alloc)]
        splits.append(np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64))
    return splits


def stratified_holdout(labels, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """[n] bool: the examples of one client (labels in any order) held out of its training.

    ceil(fraction x n) of its n examples (at least 1, and at least 1 left to train on; none
    when n < 2 or fraction is 0), drawn at random without regard to their order (an image
    folder lists its examples class by class). Stratified by label where a class has enough
    examples: each class gets its largest-remainder share of the held-out count, but always
    leaves at least one example of itself to train on; a share so capped goes to classes with
    examples to spare (chosen in proportion to how many they can spare), and only when no
    class can spare one does a class give its last training example.
    """
    labels = _as_labels(labels)
    n = len(labels)
    held = np.zeros(n, bool)
    if fraction <= 0 or n < 2:
        return held
    total = min(max(math.ceil(fraction * n - 1e-9), 1), n - 1)
    classes, counts = np.unique(labels, return_counts=True)
    alloc = np.minimum(_largest_remainder(counts.astype(np.float64), total), counts - 1)
    for _ in range(total - int(alloc.sum())):
        spare = counts - 1 - alloc
        weights = spare if spare.sum() > 0 else counts - alloc
        alloc[rng.choice(len(classes), p=weights / weights.sum())] += 1
    for c, k in zip(classes, alloc):
        held[rng.choice(np.flatnonzero(labels == c), size=k, replace=False)] = True
    return held


def partition_summary(client_train_indices, train_labels, num_classes: int) -> list[dict]:
    """Per client: {'num_examples': int, 'class_counts': [int] * num_classes} (JSON-ready)."""
    train_labels = np.asarray(train_labels)
    summary = []
    for idx in client_train_indices:
        counts = np.bincount(train_labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
        summary.append({"num_examples": int(counts.sum()), "class_counts": [int(v) for v in counts]})
    return summary
