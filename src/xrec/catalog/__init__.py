"""The item catalog (docs/catalog.md): items <-> semantic IDs and the constraint tables.

    items.py      ItemCatalog (item conversion, content hash) and ConstraintTables (CSR trie)
    formats.py    binary / extended / text catalog files (numpy only)
    importers.py  sid2pid.json, token maps and CSVs of token strings -> ItemCatalog
    sid_vocab.py  OpenOneRec's vocabulary layout; tokenizer and catalog for random models
    cli.py        `xrec catalog import`
"""

from xrec.catalog.formats import MAX_VOCAB_SIZE, CatalogError
from xrec.catalog.items import ConstraintTables, ItemCatalog, random_catalog

__all__ = ["CatalogError", "ConstraintTables", "ItemCatalog", "MAX_VOCAB_SIZE", "random_catalog"]
