"""The eight schedule families: which order each runs (``registry`` calls them by name)."""
