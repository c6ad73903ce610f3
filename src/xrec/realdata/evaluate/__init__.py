"""Offline evaluation on a leave-one-out split: `xrec eval`. Never imported by the serving path."""
