"""kvshare as SGLang HiCache's storage tier (L3), loaded with ``--hicache-storage-backend dynamic``.

- :mod:`~kvshare.sglang.pages`: SGLang's page keys as kvshare block hashes, and its host pool's
  pages as the SDK's block memory (no SGLang import);
- :mod:`~kvshare.sglang.settings`: the backend's ``--hicache-storage-backend-extra-config`` keys;
- :mod:`~kvshare.sglang.backend`: :class:`KVShareStorage`, the ``HiCacheStorage`` SGLang loads
  (imports SGLang; only in SGLang's own environment).
"""
