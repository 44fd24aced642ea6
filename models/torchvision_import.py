"""Import torchvision without TorchDynamo: 2 s off the start of the training loaders and scoring.

``import torchvision`` imports all of ``torch._dynamo`` (the torch.compile front end), for two
lines that need none of it at import time: ``tv_tensors`` decorates one helper with
``torch.compiler.disable``, and ``ops.roi_align`` imports ``is_compile_supported`` for later use.
Measured on 2 cores (torch 2.14, torchvision 0.29): torch alone 2.1 s of CPU, torch with
torchvision 4.4 s, and 2.4 s this way. The loader fork server (which the first batch waits for)
and ``imageops score`` never need TorchDynamo; a training process imports it anyway, later, when
torch.optim builds its optimizer.

While a torchvision module executes, the decorator returns its function as it is, and
``torch._dynamo.utils`` is a stand-in whose ``is_compile_supported`` imports the real one when
called (any other name does too). Both are undone once torchvision is imported, so
``torch.compile`` and everything after it get the real TorchDynamo. The one difference left:
``tv_tensors.wrap`` is not excluded from compiled graphs; imageops compiles networks only
(``params.compile``), never the transforms that call it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

_UTILS = "torch._dynamo.utils"


class _DynamoUtilsStandIn(types.ModuleType):
    """``torch._dynamo.utils`` while torchvision imports: anything asked for loads the real one."""

    @staticmethod
    def is_compile_supported(device_type: str) -> bool:
        return _real_utils().is_compile_supported(device_type)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # inspect and pickle probe every module's __file__ and such
            raise AttributeError(name)
        return getattr(_real_utils(), name)


def _real_utils() -> types.ModuleType:
    if isinstance(sys.modules.get(_UTILS), _DynamoUtilsStandIn):
        del sys.modules[_UTILS]
    return importlib.import_module(_UTILS)


class _Loader(importlib.abc.Loader):
    """torchvision's own loader, run with the two stand-ins in place."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # is_package, get_filename, resource readers
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        import torch.compiler

        disable = torch.compiler.disable
        torch.compiler.disable = _keep_function
        placed = _UTILS not in sys.modules
        if placed:
            sys.modules[_UTILS] = _DynamoUtilsStandIn(_UTILS)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compiler.disable = disable
            if placed and isinstance(sys.modules.get(_UTILS), _DynamoUtilsStandIn):
                del sys.modules[_UTILS]


def _keep_function(fn: Any = None, recursive: bool = True, *, reason: str | None = None) -> Any:
    """``torch.compiler.disable`` while torchvision imports: the function, undecorated."""
    return fn if fn is not None else (lambda f: f)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torchvision and its submodules (``transforms.v2`` imports ``tv_tensors`` long after
    the package) with their loaders wrapped."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def import_torchvision_without_dynamo() -> None:
    """Make this process's imports of torchvision skip TorchDynamo (see above)."""
    if "torchvision" in sys.modules or "torch._dynamo" in sys.modules:
        return  # too late, or nothing to save
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
