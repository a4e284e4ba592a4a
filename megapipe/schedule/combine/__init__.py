"""The combine pass: which backward runs beside which forward in an OVERLAP pair, within how
many more activations in flight."""
