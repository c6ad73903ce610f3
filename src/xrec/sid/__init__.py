"""Semantic IDs from item embeddings: `xrec sid build`. Never imported by the serving path."""
