"""Validation: does a schedule run every microbatch through every stage, in an order that
finishes (the per-action rules on the whole table, then progress and the lowered run)."""
