"""Names of everything a user can pick: models, GPUs and numeric formats.

    >>> from libratio_jax import catalog
    >>> "Llama-3.1-8B" in catalog.models() and "H100-SXM" in catalog.gpus()
    True
"""

from libratio_jax.physics.architecture import catalog_models
from libratio_jax.physics.formats import FORMAT_NAMES
from libratio_jax.physics.hardware import GPU_NAMES


def models() -> list[str]:
    """Catalog model names (shipped Hugging Face configs)."""
    return catalog_models()


def gpus() -> list[str]:
    """GPU kinds in the hardware catalog."""
    return list(GPU_NAMES)


def formats() -> list[str]:
    """Numeric format names, in id order."""
    return list(FORMAT_NAMES)
