"""Gradients to weights: bf16 main weights, flat DP buffers and their sync, AdamW."""
