"""Build of the optional native kernels (``libratio_jax.physics._native``, XLA FFI handlers for
the CPU; see ``src/libratio_jax/physics/native.py``). Everything else is in pyproject.toml.

The extension needs a C++17 compiler and the XLA FFI headers that jaxlib ships (a build
requirement). It is optional: where it cannot be built the package installs without it and
runs the same computations in XLA (``libratio_jax.physics.native.status()`` says which).
``LIBRATIO_NO_NATIVE=1`` in the environment skips it.
"""

import os

from setuptools import Extension, setup


def _ffi_include_dir():
    """jaxlib's include directory (``jax.ffi.include_dir()``), or None without jaxlib."""
    try:
        import jaxlib
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


include = _ffi_include_dir()
extensions = [] if include is None or os.environ.get("LIBRATIO_NO_NATIVE") else [Extension(
    "libratio_jax.physics._native",
    sources=["src/libratio_jax/physics/_native.cc"],
    include_dirs=[include],
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-Wno-attributes"],
    optional=True,
)]

setup(ext_modules=extensions)
