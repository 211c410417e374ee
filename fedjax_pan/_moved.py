"""Import paths of modules that moved when the package was grouped into layer folders:
each old path still imports (with a DeprecationWarning) the module at its new path, the
same module object, through the 0.2 series (0.3 drops them). `python -m <old path>` runs too."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from typing import Dict, Optional

MOVED: Dict[str, str] = {
    'fedjax_pan.algorithms.apfl': 'fedjax_pan.algorithms.personal.apfl',
    'fedjax_pan.algorithms.apple': 'fedjax_pan.algorithms.personal.apple',
    'fedjax_pan.algorithms.attacks': 'fedjax_pan.algorithms.robust.attacks',
    'fedjax_pan.algorithms.compressed': 'fedjax_pan.algorithms.uploads.compressed',
    'fedjax_pan.algorithms.ditto': 'fedjax_pan.algorithms.personal.ditto',
    'fedjax_pan.algorithms.dp': 'fedjax_pan.algorithms.uploads.dp',
    'fedjax_pan.algorithms.fd': 'fedjax_pan.algorithms.personal.fd',
    'fedjax_pan.algorithms.fed2': 'fedjax_pan.algorithms.fedavg_family.fed2',
    'fedjax_pan.algorithms.fedala': 'fedjax_pan.algorithms.personal.fedala',
    'fedjax_pan.algorithms.fedamp': 'fedjax_pan.algorithms.personal.fedamp',
    'fedjax_pan.algorithms.fedas': 'fedjax_pan.algorithms.personal.fedas',
    'fedjax_pan.algorithms.fedavg': 'fedjax_pan.algorithms.fedavg_family.fedavg',
    'fedjax_pan.algorithms.fedbabu': 'fedjax_pan.algorithms.personal.fedbabu',
    'fedjax_pan.algorithms.fedcac': 'fedjax_pan.algorithms.personal.fedcac',
    'fedjax_pan.algorithms.fedcp': 'fedjax_pan.algorithms.personal.fedcp',
    'fedjax_pan.algorithms.fedcross': 'fedjax_pan.algorithms.personal.fedcross',
    'fedjax_pan.algorithms.fedda': 'fedjax_pan.algorithms.personal.fedda',
    'fedjax_pan.algorithms.feddbe': 'fedjax_pan.algorithms.personal.feddbe',
    'fedjax_pan.algorithms.feddyn': 'fedjax_pan.algorithms.fedavg_family.feddyn',
    'fedjax_pan.algorithms.fedfomo': 'fedjax_pan.algorithms.personal.fedfomo',
    'fedjax_pan.algorithms.fedgc': 'fedjax_pan.algorithms.personal.fedgc',
    'fedjax_pan.algorithms.fedgen': 'fedjax_pan.algorithms.fedavg_family.fedgen',
    'fedjax_pan.algorithms.fedgh': 'fedjax_pan.algorithms.personal.fedgh',
    'fedjax_pan.algorithms.fedkd': 'fedjax_pan.algorithms.personal.fedkd',
    'fedjax_pan.algorithms.fedlc': 'fedjax_pan.algorithms.fedavg_family.fedlc',
    'fedjax_pan.algorithms.fedma': 'fedjax_pan.algorithms.fedavg_family.fedma',
    'fedjax_pan.algorithms.fedmtl': 'fedjax_pan.algorithms.personal.fedmtl',
    'fedjax_pan.algorithms.fedntd': 'fedjax_pan.algorithms.fedavg_family.fedntd',
    'fedjax_pan.algorithms.fedpac': 'fedjax_pan.algorithms.personal.fedpac',
    'fedjax_pan.algorithms.fedpcl': 'fedjax_pan.algorithms.personal.fedpcl',
    'fedjax_pan.algorithms.fedphp': 'fedjax_pan.algorithms.personal.fedphp',
    'fedjax_pan.algorithms.fedproto': 'fedjax_pan.algorithms.personal.fedproto',
    'fedjax_pan.algorithms.fedprox': 'fedjax_pan.algorithms.fedavg_family.fedprox',
    'fedjax_pan.algorithms.fedrep': 'fedjax_pan.algorithms.personal.fedrep',
    'fedjax_pan.algorithms.fedrod': 'fedjax_pan.algorithms.personal.fedrod',
    'fedjax_pan.algorithms.finetune': 'fedjax_pan.algorithms.fedavg_family.finetune',
    'fedjax_pan.algorithms.flchain': 'fedjax_pan.algorithms.robust.flchain',
    'fedjax_pan.algorithms.flchain_cli': 'fedjax_pan.algorithms.robust.flchain_cli',
    'fedjax_pan.algorithms.fml': 'fedjax_pan.algorithms.personal.fml',
    'fedjax_pan.algorithms.gpfl': 'fedjax_pan.algorithms.personal.gpfl',
    'fedjax_pan.algorithms.ktpfl': 'fedjax_pan.algorithms.personal.ktpfl',
    'fedjax_pan.algorithms.moon': 'fedjax_pan.algorithms.fedavg_family.moon',
    'fedjax_pan.algorithms.partialfed': 'fedjax_pan.algorithms.personal.partialfed',
    'fedjax_pan.algorithms.perfedavg': 'fedjax_pan.algorithms.personal.perfedavg',
    'fedjax_pan.algorithms.pfedeff': 'fedjax_pan.algorithms.personal.pfedeff',
    'fedjax_pan.algorithms.pfedme': 'fedjax_pan.algorithms.personal.pfedme',
    'fedjax_pan.algorithms.scaffold': 'fedjax_pan.algorithms.fedavg_family.scaffold',
    'fedjax_pan.algorithms.siren': 'fedjax_pan.algorithms.robust.siren',
    'fedjax_pan.assembly': 'fedjax_pan.run.assembly',
    'fedjax_pan.compression': 'fedjax_pan.algorithms.uploads.compression',
    'fedjax_pan.defaults': 'fedjax_pan.config.defaults',
    'fedjax_pan.distributed': 'fedjax_pan.engine.distributed',
    'fedjax_pan.engine.robust': 'fedjax_pan.algorithms.aggregation.robust',
    'fedjax_pan.engine.staleness': 'fedjax_pan.algorithms.aggregation.staleness',
    'fedjax_pan.experiment': 'fedjax_pan.run.experiment',
    'fedjax_pan.launch': 'fedjax_pan.run.launch',
    'fedjax_pan.ledger': 'fedjax_pan.algorithms.robust.ledger',
    'fedjax_pan.main': 'fedjax_pan.run.main',
    'fedjax_pan.matching': 'fedjax_pan.pan.matching',
    'fedjax_pan.permutation': 'fedjax_pan.pan.permutation',
    'fedjax_pan.privacy': 'fedjax_pan.algorithms.uploads.privacy',
    'fedjax_pan.reporting': 'fedjax_pan.run.reporting',
    'fedjax_pan.resume': 'fedjax_pan.run.resume',
    'fedjax_pan.schema': 'fedjax_pan.config.schema',
    'fedjax_pan.training': 'fedjax_pan.run.training',
}


# Old command lines whose module moved and whose command moved elsewhere again:
# `python -m fedjax_pan.ledger WORKDIR` verified a ledger, which FLChain's CLI does now.
COMMANDS: Dict[str, str] = {"fedjax_pan.ledger": "fedjax_pan.algorithms.robust.flchain_cli"}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in 0.3",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed under its new name; the import system has just set its __spec__
        # to the old path's, which would send a later find_spec of the new path here.
        module.__spec__ = self.spec

    def get_code(self, fullname: str):
        # `python -m <old path>` (runpy) runs the new module's code as __main__, or the
        # command's new module where the command moved (`COMMANDS`).
        target = COMMANDS.get(fullname, self.new)
        return importlib.util.find_spec(target).loader.get_code(target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        origin = importlib.util.find_spec(new).origin
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), origin=origin)


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before path finders: an old path wins
