"""A fake ``habana_frameworks`` for CPU machines: records every call fprep makes, in order.

``install(monkeypatch, lazy=True)`` puts the package's modules in ``sys.modules`` and returns
the shared call log. Importing a module is logged too ("import habana_frameworks.torch.core"),
since importing is how the Gaudi stack registers the device and the hccl backend.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from torch import nn


class Log(list[str]):
    def names(self) -> list[str]:
        return [entry.split("(")[0] for entry in self]


def install(monkeypatch: pytest.MonkeyPatch, *, lazy: bool = True) -> Log:
    log = Log()
    for name in [m for m in sys.modules if m.startswith("habana_frameworks")]:
        monkeypatch.delitem(sys.modules, name)

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    def recorder(name: str, result: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            log.append(f"{name}({', '.join(map(repr, args))})")
            return result

        return call

    class TELinear(nn.Linear):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            log.append("te.Linear")
            super().__init__(*args, **kwargs)

    module("habana_frameworks", __path__=[])
    module("habana_frameworks.torch", __path__=[])
    module("habana_frameworks.torch.core", mark_step=recorder("mark_step"))
    module("habana_frameworks.torch.distributed", __path__=[])
    module("habana_frameworks.torch.distributed.hccl")
    module("habana_frameworks.torch.utils", __path__=[])
    module("habana_frameworks.torch.utils.internal", is_lazy=lambda: lazy)
    module(
        "habana_frameworks.torch.hpu",
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=recorder("synchronize"),
    )
    module("habana_frameworks.torch.hpex", __path__=[])
    module("habana_frameworks.torch.hpex.experimental", __path__=[])
    module("habana_frameworks.torch.hpex.experimental.transformer_engine", Linear=TELinear)

    import importlib

    real_import_module = importlib.import_module

    def logging_import_module(name: str, package: str | None = None) -> Any:
        if name.startswith("habana_frameworks"):
            log.append(f"import {name}")
        return real_import_module(name, package)

    monkeypatch.setattr(importlib, "import_module", logging_import_module)
    return log
