"""The eight schedule families' generators and their shared tools: which order each named schedule
runs on each rank (``registry`` calls them by name)."""
