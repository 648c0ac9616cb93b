"""Data defaults that the library's corpus functions and the run config share, declared once here: the config's
`data` section takes its defaults from this module (islands never import the config, which lives above them)."""

HELDOUT_FRACTION = 0.02
"""Fraction of files (stdlib), rows (Parquet) or units (token files) held out for evaluation."""

SHUFFLE_DOCUMENTS = True
"""Units, rows and windows in seeded orders, so that each island reads a representative sample."""
