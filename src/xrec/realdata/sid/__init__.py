"""Semantic IDs from item embeddings: `xrec sid build`. Never imported by the serving path.

The names below load their module on first use, so `xrec --help` imports nothing heavy."""

from __future__ import annotations

import importlib

__all__ = ["SidResult", "build_sid_dir", "build_sids", "interaction_embeddings",
           "load_embeddings", "residual_kmeans", "text_embeddings", "write_sid_dir"]

_MODULES = {"SidResult": "build", "build_sid_dir": "build", "build_sids": "build",
            "write_sid_dir": "build", "residual_kmeans": "kmeans",
            "interaction_embeddings": "embeddings", "load_embeddings": "embeddings",
            "text_embeddings": "embeddings"}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'xrec.realdata.sid' has no attribute {name!r}")
    return getattr(importlib.import_module(f"xrec.realdata.sid.{_MODULES[name]}"), name)
