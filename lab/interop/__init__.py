"""Interop matrix: ExaBGP → third-party transit (FRR, BIRD, GoBGP) → ExaBGP.

`python -m lab.interop.matrix` (or `catsproto interop`) runs it; see docs/interop.md.
"""
