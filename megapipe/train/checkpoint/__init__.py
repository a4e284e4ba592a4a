"""Checkpoints: the state keyed by what each tensor is, whole-or-nothing files, the resume (or
the ``--load-hf`` start); a checkpoint read in one process and exported to Hugging Face."""
