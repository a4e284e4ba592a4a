"""The overlap pass: which backward runs beside which forward, within an in-flight budget."""
