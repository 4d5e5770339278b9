"""What a loss's backward will reach: the leaf tensors of its autograd graph."""

from __future__ import annotations

from typing import Any

import torch


def graph_leaves(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) ``loss``'s backward accumulates into."""
    leaves: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves
