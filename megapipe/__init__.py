"""megapipe: hide the expert-parallel all-to-all of MoE training behind computation.

The public API is re-exported here; everything else may change.
"""

__version__ = "0.1.0"
