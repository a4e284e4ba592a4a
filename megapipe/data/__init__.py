"""Real training data: tokenizers, Megatron's indexed datasets, and reading them for training.

``tokenizer`` (the byte level and Hugging Face tokenizers, Megatron's padded vocabulary,
``check_vocab``), ``train_tokenizer`` (``megapipe train-tokenizer``), ``preprocess``
(``megapipe preprocess-data``: jsonl to Megatron's ``.bin``/``.idx``), ``blend``
(``--data-path`` and ``--split`` checked before any process group), ``gpt_samples``
(Megatron's ``GPTDataset`` samples as this rank's microbatches), ``raw_text`` (text files
read byte level, the demo's data, as this rank's microbatches), ``bits_per_byte`` (the
validation's loss per byte of text), ``commands`` (the two subcommands), ``mcore_datasets``
(megatron-core's data classes, or one error saying it is missing) and ``errors`` (``DataError``,
the one-line error). Megatron-Core's own data pipeline writes and reads the files; this package
imports nothing else of megapipe.
"""
