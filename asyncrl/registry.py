"""A tiny name→object registry, shared by algorithms, engines and reward rules.

Entries are either objects registered with a decorator or lazy "module:attr" import paths, so that
optional engines (vLLM, SGLang) are imported only when a config picks them.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


def import_path(spec: str) -> Any:
    """Import 'pkg.module:attr' (attr may be dotted). Raises ValueError with one clear line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not an import path of the form 'pkg.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} ({exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


class Registry(Generic[T]):
    """Maps names to objects; `kind` names the registry in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T | str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def register_lazy(self, name: str, path: str) -> None:
        """Register 'module:attr', imported on first `get`."""
        self._items[name] = path

    def get(self, name: str) -> T:
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}")
        item = self._items[name]
        if isinstance(item, str):
            item = import_path(item)
            self._items[name] = item
        return item  # type: ignore[return-value]

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's or plug-in's temporary entry); KeyError if it is not registered."""
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}")
        del self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
