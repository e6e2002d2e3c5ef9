"""`static-decode bench`: the systems it times side by side, the run, the report."""
