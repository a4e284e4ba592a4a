"""Real training data: tokenizers, Megatron's indexed datasets, and reading them for training.

``tokenizer`` (the byte-level and Hugging Face tokenizers, Megatron's padded vocabulary),
``train_tokenizer`` (``megapipe train-tokenizer``), ``preprocess`` (``megapipe preprocess-data``:
jsonl to Megatron's ``.bin``/``.idx``), ``blend`` (``--data-path`` and ``--split`` checked
before any process group), ``gpt_samples`` (Megatron's ``GPTDataset`` samples as this rank's
microbatches), ``bits_per_byte`` (the validation's loss per byte) and ``commands`` (the two
subcommands). Megatron-Core's own data pipeline writes and reads the files; this package
imports nothing of the training app or the engine.
"""
