"""Weight divergence across local models (PAN paper, Sect. 5.2 "I. Weight Divergence", Fig. 6).

For every layer l: (1/|S|) sum_{k in S} ||W_l^(k) - W_l||_2, with W_l the plain mean of the
local models (or a given reference, e.g. the global model). A "layer" is a top-level key of
the params dict ('fc1', 'conv3', 'fc1_norm', 'head', ...); its norm is the Euclidean norm of
all its parameter leaves flattened and concatenated (kernel and bias together), or of one
leaf only with `leaf='kernel'`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import jax
import numpy as np

Params = Mapping[str, Any]


def _unwrap(tree: Any) -> Any:
    # Full variables ({'params': ..., 'batch_stats': ...}) are accepted for convenience.
    if isinstance(tree, Mapping) and "params" in tree:
        return tree["params"]
    return tree


def _layer_vector(subtree: Any, leaf: Optional[str]) -> Optional[np.ndarray]:
    """The layer's parameters as one float64 vector (None if it lacks the requested leaf)."""
    if leaf is not None:
        if not isinstance(subtree, Mapping) or leaf not in subtree:
            return None
        subtree = subtree[leaf]
    leaves = jax.tree_util.tree_leaves(subtree)
    if not leaves:
        return None
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])


def _as_client_list(local_params: Union[Sequence[Params], Params]) -> List[Params]:
    if isinstance(local_params, Mapping):
        # A stacked pytree: every leaf carries a leading client axis.
        stacked = _unwrap(local_params)
        sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(stacked)}
        if len(sizes) != 1:
            raise ValueError(f"stacked params need one common leading client axis, got {sizes}")
        n = sizes.pop()
        return [jax.tree_util.tree_map(lambda x, k=k: np.asarray(x)[k], stacked)
                for k in range(n)]
    return [_unwrap(p) for p in local_params]


def weight_divergence(local_params: Union[Sequence[Params], Params],
                      reference: Optional[Params] = None,
                      leaf: Optional[str] = None) -> Dict[str, float]:
    """Per-layer weight divergence (1/|S|) sum_k ||W_k - W_ref||_2 (PAN paper, Fig. 6).

    local_params: a list of params pytrees, or one stacked pytree whose leaves have a
    leading client axis (a Mapping is taken as stacked). W_ref is the clients' mean unless
    `reference` (an unstacked params pytree) is given. `leaf='kernel'` restricts each layer
    to that leaf (layers without it are left out); by default all leaves count together.
    """
    clients = _as_client_list(local_params)
    if not clients:
        raise ValueError("weight_divergence needs at least one local model")
    ref = None if reference is None else _unwrap(reference)
    out: Dict[str, float] = {}
    for name in clients[0]:
        vectors = [_layer_vector(c[name], leaf) for c in clients]
        if vectors[0] is None:
            continue
        stack = np.stack(vectors)  # (K, P); shapes must agree across clients
        if ref is None:
            center = stack.mean(axis=0)
        else:
            center = _layer_vector(ref[name], leaf)
            if center is None or center.shape != stack.shape[1:]:
                raise ValueError(f"reference does not match layer {name!r}")
        out[name] = float(np.linalg.norm(stack - center, axis=1).mean())
    return out


__all__ = ["weight_divergence"]
