"""What the `xrec bench` commands share: workloads, contenders, timing, output files."""
