"""Training models from interaction sequences: `xrec train`. Never imported by the serving path."""
