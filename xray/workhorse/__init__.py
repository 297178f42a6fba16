"""Workhorse: one device's shard of one model (a Ray actor in production, a plain class in tests).

`base` (the life cycle every Workhorse shares), `echo` (no model: cluster and protocol checks),
and the role Workhorses built on backend engines.
"""
from xray.workhorse.base import Workhorse

__all__ = ["Workhorse"]
