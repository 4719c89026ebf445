"""Build hook: the one import name and the optional C accelerators; other metadata lives in
pyproject.toml.

Installed, the project claims only ``kvshare``: the top-level folders ``actors/`` and ``router/``
install as ``kvshare.actors`` and ``kvshare.router`` (DESIGN.md, "Layout").


``kvshare._native._chain`` runs the sha256 block-hash chain loop in C with OpenSSL's libcrypto (and the
opt-in xxh3-128 chain with the ``xxhash`` package's own XXH3_128bits, found at run time);
``kvshare._native._plan`` is the cost model's cut-point scan; ``kvshare._native._copy`` copies pool blocks with non-temporal stores; ``kvshare._native._statemap`` is the
block index's hash table (block hash -> holder state); ``kvshare._native._hashq`` checksums NIXL
reads in a native thread while they land; ``kvshare._native._pending`` and ``kvshare._native._ready`` are the
router's books of blocks its decisions are creating (``kvshare.router.core.pending``, ``kvshare.router.core.ready``);
``kvshare._native._select`` is the cost policy's candidate loop over them (``kvshare.router.core.policy``). All are ``optional``: where no
compiler (or no OpenSSL headers) is found, the build prints a warning, installs without them and
``kvshare.hashing`` / ``kvshare.tiers.base.copy_block`` / the index table use their pure-Python/numpy paths (same
results, slower).
"""

from setuptools import Extension, find_packages, setup

PACKAGE_DIR = {"kvshare.actors": "actors", "kvshare.router": "router"}
PACKAGES = find_packages(include=["kvshare", "kvshare.*"], exclude=["kvshare.actors*", "kvshare.router*"]) + [
    f"kvshare.{name}" for name in find_packages(include=["actors", "actors.*", "router", "router.*"])
]

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=[
        Extension(
            "kvshare._native._chain",
            sources=["kvshare/_native/_chain.c", "kvshare/_native/_chain_memo.c", "kvshare/_native/_chain_xxh3.c"],
            depends=["kvshare/_native/_u32.h"],
            libraries=["crypto", "dl"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._native._statemap",
            sources=["kvshare/_native/_statemap.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._native._hashq",
            sources=["kvshare/_native/_hashq.c"],
            extra_compile_args=["-O2"],
            libraries=["dl", "pthread"],
            optional=True,
        ),
        Extension(
            "kvshare._native._plan",
            sources=["kvshare/_native/_plan.c"],
            depends=["kvshare/_native/_scan.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "kvshare._native._pending",
            sources=["kvshare/_native/_pending.c"],
            depends=["kvshare/_native/_books.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._native._ready",
            sources=["kvshare/_native/_ready.c"],
            depends=["kvshare/_native/_books.h", "kvshare/_native/_ready.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvshare._native._select",
            sources=["kvshare/_native/_select.c"],
            depends=["kvshare/_native/_books.h", "kvshare/_native/_ready.h", "kvshare/_native/_scan.h"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "kvshare._native._copy",
            sources=["kvshare/_native/_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
