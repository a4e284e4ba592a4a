"""Checkpoints: the state keyed by what each tensor is, whole-or-nothing files, the resume."""
