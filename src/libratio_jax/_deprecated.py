"""Old module paths kept for one release (0.2): each forwards to the module's new home and
warns once on first use. They import their target lazily (on first attribute access), so the
layering contract (``lint-imports``) sees no upward import from them."""

from __future__ import annotations

import importlib
import warnings


def moved(old: str, new: str, *more: str):
    """A module ``__getattr__`` for the alias ``old`` of module ``new`` (names not found there
    are looked up in ``more``, the other modules the old one was split into)."""

    def __getattr__(name: str):
        if not name.startswith("__"):
            for target in (new, *more):
                module = importlib.import_module(target)
                if hasattr(module, name):
                    warnings.warn(f"{old} moved to {target}; the old path is removed in 0.3",
                                  DeprecationWarning, stacklevel=2)
                    return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
