"""megapipe.hf: checkpoints to and from Hugging Face's format (Qwen3-MoE).

- ``hf.export.export_hf`` (``megapipe export-hf``, ``hf.command``) writes a checkpoint of any
  layout as a ``Qwen3MoeForCausalLM`` directory;
- ``hf.load_hf.load_hf`` reads such a directory back into a ``GPTConfig`` and a state dict, and
  ``hf.checkpoint_reader.copy_into_stage`` fills the stages of any layout with it;
- ``hf.checkpoint_reader`` reads a checkpoint's config and tensors in one process;
- ``hf.qwen3_moe`` holds the field and tensor mapping, ``hf.tokenizer_files`` the tokenizer.

Needs ``safetensors`` and ``tokenizers`` (the ``hf`` extra). Only ``cli.py`` imports it; nothing
is imported here, so the CLI's parser stays torch-free.
"""
