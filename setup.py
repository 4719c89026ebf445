"""Build hook for the optional C accelerators; all metadata lives in pyproject.toml.

``kvshare._chain`` runs the sha256 block-hash chain loop in C with OpenSSL's libcrypto (and the
opt-in xxh3-128 chain with the ``xxhash`` package's own XXH3_128bits, found at run time);
``kvshare._plan`` is the cost model's cut-point scan; ``kvshare._copy`` copies pool blocks with non-temporal stores; ``kvshare._statemap`` is the
block index's hash table (block hash -> holder state); ``kvshare._hashq`` checksums NIXL
reads in a native thread while they land; ``kvshare._pending`` and ``kvshare._ready`` are the
router's books of blocks its decisions are creating (``router.pending``, ``router.ready``);
``kvshare._select`` is the cost policy's candidate loop over them (``router.policy``). All are ``optional``: where no
compiler (or no OpenSSL headers) is found, the build prints a warning, installs without them and
``kvshare.hashing`` / ``kvshare.tiers.base.copy_block`` / the index table use their pure-Python/numpy paths (same
results, slower).
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
            "kvshare._hashq",
            sources=["kvshare/_hashq.c"],
            extra_compile_args=["-O2"],
            libraries=["dl", "pthread"],
            optional=True,
        ),
        Extension(
            "kvshare._plan",
            sources=["kvshare/_plan.c"],
            depends=["kvshare/_scan.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "kvshare._pending",
            sources=["kvshare/_pending.c"],
            depends=["kvshare/_books.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._ready",
            sources=["kvshare/_ready.c"],
            depends=["kvshare/_books.h", "kvshare/_ready.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._select",
            sources=["kvshare/_select.c"],
            depends=["kvshare/_books.h", "kvshare/_ready.h", "kvshare/_scan.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
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
