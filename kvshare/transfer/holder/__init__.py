"""The holding pool's side of every transport: serving blocks from a pool (shm control, NIXL
source, object store) and building an in-process pool with its source.
"""
