"""Build hook for the optional C accelerator; all metadata lives in pyproject.toml.

``kvshare._chain`` runs the sha256 block-hash chain loop in C with OpenSSL's libcrypto. It is
``optional``: where no compiler or OpenSSL headers are found, the build prints a warning,
installs without it and ``kvshare.hashing`` uses its pure-Python loop (same hashes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvshare._chain",
            sources=["kvshare/_chain.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
