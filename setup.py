"""Build hook for the optional C accelerators (the one place they are built); all metadata
lives in pyproject.toml.

Three, each kept because it lifts the figure it serves by >= 1.3x over its Python twin
(``benchmarks/native_value.py`` measures both in one run):

- ``kvshare._chain``: the sha256 block-hash chain loop in C with OpenSSL's libcrypto (and the
  opt-in xxh3-128 chain with the ``xxhash`` package's own XXH3_128bits, found at run time):
  hashing tokens/s (``kvshare.hashing``);
- ``kvshare._statemap``: the block index's hash table (block hash -> holder state): index
  events/s and match/s (``kvshare.statemap``);
- ``kvshare._copy``: pool block copies with non-temporal stores: host tier GB/s
  (``kvshare.tiers.base.copy_block``).

All are ``optional``: where no compiler (or no OpenSSL headers) is found, the build prints a
warning and installs without them, and those modules run their pure-Python/numpy paths (same
results, slower). ``tests/test_native_conformance.py`` runs one suite over both.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvshare._chain",
            sources=["kvshare/_chain.c", "kvshare/_chain_memo.c", "kvshare/_chain_xxh3.c"],
            depends=["kvshare/_u32.h"],
            libraries=["crypto", "dl"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._statemap",
            sources=["kvshare/_statemap.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._copy",
            sources=["kvshare/_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
