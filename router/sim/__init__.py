"""The trace simulator: replay through the real policy code, the real index and pool bookkeeping
on a modelled cluster; trace readers, the peers' routing rules, replicas and reports.
"""
