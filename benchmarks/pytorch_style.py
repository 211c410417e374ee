"""A third baseline: FedAvg written as PFLlib runs it, in PyTorch (on the CPU, or `device`).

PFLlib's clients (`clientavg.train`): each sampled client copies the global model, builds
`torch.optim.SGD(lr)` and a `DataLoader(batch_size=B, shuffle=True, drop_last=False)` over
its examples, and runs E epochs of forward, `zero_grad`, backward and step; the server
averages the clients' parameters weighted by their example counts. The MLP is the
benchmark's (784-1024x3-10, ReLU), its weights copied from the JAX model, so the first
round, given the engine's batch order, equals the engine's FedAvg up to float32 rounding.

Optional: the suite runs this row only where `torch` imports (`pip install torch==2.13.0`,
a CPU build, is what `make bench` installs on this machine kind).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from benchmarks.naive import OrderFn

PyTree = Any


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


class PyTorchStyleFedAvg:
    """FedAvg rounds as PFLlib runs them (a DataLoader per client, one step per batch)."""

    def __init__(self, params: PyTree, learning_rate: float = 0.05, momentum: float = 0.0,
                 batch_size: int = 64, epochs: int = 5, seed: int = 0, device: str = "cpu"):
        import torch

        if int(epochs) != epochs or epochs < 1:
            raise ValueError(f"the PyTorch-style loop runs whole epochs only, got {epochs}")
        self.torch, self.device = torch, torch.device(device)
        self.lr, self.momentum = float(learning_rate), float(momentum)
        self.batch_size, self.epochs = int(batch_size), int(epochs)
        self.generator = torch.Generator().manual_seed(seed)
        self.names = [n for n in params if n != "head"] + ["head"]
        layers = []
        for i, name in enumerate(self.names):
            kernel = np.asarray(params[name]["kernel"])
            linear = torch.nn.Linear(kernel.shape[0], kernel.shape[1])
            layers.append(linear)
            if i < len(self.names) - 1:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(torch.nn.Flatten(), *layers).to(self.device)
        self.load(params)
        self.loss = torch.nn.CrossEntropyLoss()

    def _linears(self, model=None):
        return [m for m in (model or self.model) if isinstance(m, self.torch.nn.Linear)]

    def load(self, params: PyTree) -> None:
        """The JAX params into the torch model (kernel (in, out) -> weight (out, in))."""
        with self.torch.no_grad():
            for linear, name in zip(self._linears(), self.names):
                linear.weight.copy_(self.torch.from_numpy(
                    np.ascontiguousarray(np.asarray(params[name]["kernel"]).T)))
                linear.bias.copy_(self.torch.from_numpy(np.array(params[name]["bias"])))

    def params(self) -> Dict[str, Dict[str, np.ndarray]]:
        """The global model as JAX-layout params."""
        return {name: {"kernel": linear.weight.detach().cpu().numpy().T.copy(),
                       "bias": linear.bias.detach().cpu().numpy().copy()}
                for linear, name in zip(self._linears(), self.names)}

    def _loader(self, x, y, order_rows: Optional[Sequence[np.ndarray]]):
        torch = self.torch
        if order_rows is None:  # PFLlib's loader
            dataset = torch.utils.data.TensorDataset(x, y)
            loader = torch.utils.data.DataLoader(dataset, self.batch_size, shuffle=True,
                                                 drop_last=False, generator=self.generator)
            for _ in range(self.epochs):
                yield from loader
        else:  # the engine's order, for the agreement check
            for perm in order_rows:
                for start in range(0, len(perm), self.batch_size):
                    rows = torch.from_numpy(perm[start:start + self.batch_size])
                    yield x[rows], y[rows]

    def round(self, images: np.ndarray, labels: np.ndarray,
              client_indices: Sequence[np.ndarray], order: Optional[OrderFn] = None
              ) -> Tuple[None, int]:
        """One round on these clients; the global model stays in `self.model`."""
        import copy

        torch = self.torch
        total = float(sum(len(rows) for rows in client_indices))
        new = [torch.zeros_like(p) for p in self.model.parameters()]
        examples = 0
        for m, rows in enumerate(client_indices):
            model = copy.deepcopy(self.model)
            opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)
            x = torch.from_numpy(np.ascontiguousarray(images[rows]))
            y = torch.from_numpy(np.asarray(labels[rows], np.int64))
            orders = None if order is None else [order(m, e, len(rows))
                                                 for e in range(self.epochs)]
            model.train()
            for xb, yb in self._loader(x, y, orders):
                # PFLlib keeps the data on the host and moves each batch to the device.
                xb, yb = xb.to(self.device), yb.to(self.device)
                loss = self.loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                examples += len(yb)
            with torch.no_grad():
                for acc, p in zip(new, model.parameters()):
                    acc.add_(p, alpha=len(rows) / total)
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), new):
                p.copy_(value)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return None, examples
