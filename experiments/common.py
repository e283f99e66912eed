"""Shared helpers of the experiment scripts: where results go, JSON and line plots."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def result_path(name: str, ext: str, out_dir: str | None = None) -> str:
    """``{out_dir or experiments/results}/{name}.{ext}`` (the folder is created)."""
    folder = out_dir or RESULTS
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{name}.{ext}")


def save_json(path: str, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


def plot_lines(path: str, curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str, hlines: Mapping[str, float] | None = None,
               logx: bool = False, logy: bool = False) -> str:
    """One PNG with a line per curve (``name -> (x, y)``) and optional horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker="o" if len(x) <= 12 else None, markersize=3, label=name)
    for k, (name, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, linestyle="--", color=f"C{len(curves) + k}", label=name)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
