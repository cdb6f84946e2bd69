"""Compatibility facades for other data-movement APIs.

``datamover.compat.nixl`` mirrors NIXL's Python API (``nixl._api``) on top of
``datamover.agents.Agent``: a NIXL program runs by changing its import.
"""
