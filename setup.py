"""Build hook: the one import name and the optional C accelerators (the one place they are
built); other metadata lives in pyproject.toml.

Installed, the project claims only ``kvshare``: the top-level folders ``actors/`` and ``router/``
install as ``kvshare.actors`` and ``kvshare.router`` (DESIGN.md, "Layout"); ``kvshare/actors``
and ``kvshare/router`` are links to them, so a checkout, mypy and pytest see the same names.

Three C accelerators live in ``kvshare/_native/``, each kept because it lifts the figure it
serves by >= 1.3x over its Python twin (``benchmarks/native_value.py`` measures both in one
run; the table is on the results page):

- ``kvshare._native._chain``: the sha256 block-hash chain loop in C with OpenSSL's libcrypto
  (and the opt-in xxh3-128 chain with the ``xxhash`` package's own XXH3_128bits, found at run
  time): hashing tokens/s (``kvshare.hashing``);
- ``kvshare._native._statemap``: the block index's hash table (block hash -> holder state):
  index events/s and match/s (``kvshare.statemap``);
- ``kvshare._native._copy``: pool block copies with non-temporal stores: host tier GB/s
  (``kvshare.tiers.base.copy_block``).

All are ``optional``: where no compiler (or no OpenSSL headers) is found, the build prints a
warning and installs without them, and those modules run their pure-Python/numpy paths (same
results, slower). ``tests/kvshare/test_native_conformance.py`` runs one suite over both.
"""

from setuptools import Extension, find_packages, setup

PACKAGE_DIR = {"kvshare.actors": "actors", "kvshare.router": "router"}
PACKAGES = find_packages(include=["kvshare", "kvshare.*"], exclude=["kvshare.actors*", "kvshare.router*"]) + [
    f"kvshare.{name}" for name in find_packages(include=["actors", "actors.*", "router", "router.*"])
]
NATIVE = "kvshare/_native"


def native(name: str, sources: list[str], **options: object) -> Extension:
    """One optional C accelerator ``kvshare._native.<name>`` built from ``kvshare/_native``."""
    return Extension(f"kvshare._native.{name}", sources=[f"{NATIVE}/{s}" for s in sources],
                     extra_compile_args=["-O2"], optional=True, **options)  # type: ignore[arg-type]


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=[
        native("_chain", ["_chain.c", "_chain_memo.c", "_chain_xxh3.c"],
               depends=[f"{NATIVE}/_u32.h"], libraries=["crypto", "dl"]),
        native("_statemap", ["_statemap.c"]),
        native("_copy", ["_copy.c"]),
    ],
)
