"""C accelerators, each with a pure-Python twin that gives the same results. Built by setup.py
(optional: where no compiler is found the Python twin runs); each kept module earns its place by
a user-visible figure (see the results page) and has one conformance suite run over both.
"""
