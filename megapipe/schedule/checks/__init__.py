"""Validation: does a schedule run every microbatch through every stage, and finish."""
