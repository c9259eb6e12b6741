"""Parts of a model's variables as nested dicts: which part a leaf belongs to, taking a part, putting
parts together.

A model's structure names each prunable layer's part (`Layer.part`: SPATL's shared `encoder` and
private `predictor`, `shared`, `private`), and a leaf belongs to the part of the layer that owns it
(`core.structure.layer_groups`: a layer's kernel, bias, normalization and statistics). Methods that send or keep
only a part of the model (SPATL's encoder, FedPer's predictor, FedBN's normalization) take it with
`take_part` and put it back with `overlay`; `merge` joins parts that share no leaf.

    >>> labels = {"params": {"fc1": {"kernel": "encoder"}, "fc2": {"kernel": "predictor"}}}
    >>> variables = {"params": {"fc1": {"kernel": 1.0}, "fc2": {"kernel": 2.0}}}
    >>> encoder = take_part(variables, labels, "encoder")
    >>> encoder
    {'params': {'fc1': {'kernel': 1.0}}}
    >>> overlay(variables, {"params": {"fc1": {"kernel": 5.0}}})["params"]["fc1"]
    {'kernel': 5.0}
    >>> merge(encoder, take_part(variables, labels, "predictor")) == variables
    True
"""

from __future__ import annotations

from typing import Any

import jax

from fedjax_sparse.core.structure.layer_groups import model_layer_groups


def part_labels(model) -> Any:
    """A tree shaped like the model's variables whose leaves name each leaf's part ('encoder', ...).

    A leaf belongs to the part of the structure layer that owns it (`core.structure.layer_groups`).
    """
    groups = model_layer_groups(model)
    return jax.tree_util.tree_map(lambda l: model.structure.layers[l].part, groups.index)


def take_part(tree: dict, labels: Any, part: str) -> dict:
    """The sub-tree of `tree` (a nested dict shaped like `labels`) holding only leaves of `part`.

    Dicts left empty are dropped, so the result is a genuine, smaller pytree (a message or
    server state that holds nothing of the other parts).
    """
    out = {}
    for key, value in tree.items():
        label = labels[key]
        if isinstance(value, dict):
            sub = take_part(value, label, part)
            if sub:
                out[key] = sub
        elif label == part:
            out[key] = value
    return out


def overlay(base: dict, top: dict) -> dict:
    """`base` with every leaf `top` holds replaced by top's, and top's keys that `base` lacks added."""
    out = dict(base)
    for key, value in top.items():
        out[key] = overlay(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return out


def merge(a: dict, b: dict) -> dict:
    """The union of two nested dicts that share no leaf (a ValueError names a leaf both hold)."""
    out = dict(a)
    for key, value in b.items():
        if key not in a:
            out[key] = value
        elif isinstance(value, dict) and isinstance(a[key], dict):
            out[key] = merge(a[key], value)
        else:
            raise ValueError(f"merge: both trees hold {key!r}; merge joins trees that share no leaf (overlay "
                             f"replaces one's leaves by the other's)")
    return out
