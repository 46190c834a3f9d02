"""One walk over a state tree (nested dicts, lists, tuples), shared by every part that needs one.

Staging copies a tree, the payload writer takes its tensors out and the reader puts
them back; all three must agree on what a container is and how it is rebuilt, so
they use this one function.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

TreePath = tuple[Any, ...]
"""The keys and list or tuple indices from the root of a tree to one node."""


def map_tree(tree: Any, leaf_fn: Callable[[Any, TreePath], Any], path: TreePath = (), *,
             is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """A copy of ``tree`` with ``leaf_fn(node, path)`` in place of each leaf.

    Containers are mappings (rebuilt as an OrderedDict if they were one, else as a
    dict), lists (rebuilt as lists) and tuples (namedtuples rebuilt as their own type,
    any other tuple as a plain tuple); everything else is a leaf. A node for which
    ``is_leaf`` returns True is a leaf too, container or not: it is checked first, on
    the way down, so it can also reject a container before anything inside is visited.
    """
    if is_leaf is not None and is_leaf(tree):
        return leaf_fn(tree, path)
    if isinstance(tree, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for key, value in tree.items():
            out[key] = map_tree(value, leaf_fn, (*path, key), is_leaf=is_leaf)
        return out
    if isinstance(tree, list):
        return [map_tree(v, leaf_fn, (*path, i), is_leaf=is_leaf) for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        items = [map_tree(v, leaf_fn, (*path, i), is_leaf=is_leaf) for i, v in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return leaf_fn(tree, path)


__all__ = ["TreePath", "map_tree"]
