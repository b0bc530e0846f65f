"""Where a fuse row's hashing parameters sit in the fleet probe's parameter table.

`fleet.FleetProbe` keeps one row per binary fuse filter in `_par` (row x parameter) and
the compiled pass (`probe_pass.py`) reads a row's parameters by these column numbers:
both import them from here, so neither module imports the other's internals.
"""

P_SALT0, P_SALT1, P_STARTS, P_SEG_LOG2, P_SEG_MASK, P_M, P_OFFSET, P_SEG, P_FOUR = range(9)
P_WIDTH = 9
