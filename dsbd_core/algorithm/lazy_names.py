"""A package's names resolved on first use (PEP 562): `dsbd_core` and `dsbd_core.models` name
their classes and functions at the top while a process that needs none of them (the CLI's
parser, Serve's ingress and session registry) imports neither torch nor transformers for them.
A Serve replica's imports are most of the CPU it spends starting."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    home: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's `__getattr__` and `__dir__`: `exports` maps each name to the module, relative
    to the package `home`, that defines it; a name once looked up is stored in the package's
    `namespace` (its `globals()`), so later lookups never reach `__getattr__`."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{home}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
