"""megapipe.hf: Hugging Face's MoE formats (Qwen3-MoE, Mixtral, OLMoE) for megapipe's GPT.

- ``hf.architectures`` holds the families and reads their ``config.json``, ``hf.export_config``
  chooses the family a model is written as and writes its ``config.json``, ``hf.tensors`` the
  tensor mapping both ways, ``hf.tokenizer_files`` the tokenizer files an export carries;
- ``hf.load_hf`` reads such a directory into a ``GPTConfig`` and a state dict (``--load-hf``),
  which ``models.split.copy_into_stage`` copies into the stages of any layout.

The export of a checkpoint (``megapipe export-hf``) reads the training app's checkpoints, so it
lives with them: ``train/checkpoint/export_hf.py``. Needs ``safetensors`` and ``tokenizers``
(the ``hf`` extra); nothing is imported here.
"""
