"""Heterogeneous least-squares clients with a known global optimum (for convergence tests).

Client k holds rows (a_i, b_i) and the objective f_k(w) = 1/(2 n_k) sum_i (a_i.w - b_i)^2.
The inputs are (n, d+1, 1, 1) images [a_i, b_i] (the target rides along as the last
feature because ClientData labels are int32). Clients differ in curvature (a_i's scale)
and in their own optimum, so FedAvg with several local steps has a biased fixed point.
"""

from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from fedjax_pan.engine import ClientData


class Residual(nn.Module):
    """a.w - b for inputs [a, b] of shape (N, d+1, 1, 1)."""

    dim: int

    @nn.compact
    def __call__(self, x, train=False, mask=None):
        del train, mask
        w = self.param("w", nn.initializers.zeros, (self.dim,))
        x = x.reshape(x.shape[0], -1)
        return x[:, :self.dim] @ w - x[:, self.dim]


def squared_loss(out, y, mask):
    """Sum over real examples of r^2 / 2 (the labels are unused)."""
    del y
    return 0.5 * jnp.sum(out ** 2 * mask)


class Quadratic(NamedTuple):
    model: Residual
    variables: dict  # w = 0
    data: ClientData
    optimum: np.ndarray  # argmin_w (1/K) sum_k f_k(w)


def quadratic_clients(dim: int = 3, size: int = 8, scales=(0.5, 1.0, 1.5, 2.0),
                      seed: int = 0) -> Quadratic:
    """One client per curvature scale, each with its own optimum and noisy targets."""
    rng = np.random.default_rng(seed)
    images, parts = [], []
    for k, s in enumerate(scales):
        a = s * rng.normal(size=(size, dim))
        b = a @ rng.normal(size=dim) + 0.1 * rng.normal(size=size)
        images.append(np.concatenate([a, b[:, None]], axis=1))
        parts.append(np.arange(k * size, (k + 1) * size))
    x = np.concatenate(images).astype(np.float32)[:, :, None, None]
    # The normal equations of the float32 data the clients see, solved in float64.
    x64 = x[:, :, 0, 0].astype(np.float64)
    hess = sum(x64[p, :dim].T @ x64[p, :dim] for p in parts) / size
    rhs = sum(x64[p, :dim].T @ x64[p, dim] for p in parts) / size
    data = ClientData.create(x, np.zeros(len(x), np.int32), parts, num_classes=1)
    model = Residual(dim)
    variables = {"params": {"w": jnp.zeros((dim,), jnp.float32)}}
    return Quadratic(model, variables, data, np.linalg.solve(hess, rhs))


def client_gradients(q: Quadratic) -> list:
    """Client k's full-batch gradient of f_k(w) = 1/(2 n_k) |A_k w - b_k|^2, in NumPy
    (float64), for reference loops written independently of the engine."""
    x = np.asarray(q.data.images, np.float64)[:, :, 0, 0]
    parts = [np.asarray(q.data.index_table[k])[:int(q.data.sizes[k])]
             for k in range(q.data.num_clients)]
    dim = q.optimum.shape[0]
    return [lambda w, a=x[p, :dim], b=x[p, dim]: a.T @ (a @ w - b) / len(b) for p in parts]
