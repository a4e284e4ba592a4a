"""megapipe.megatron: Megatron's front end (get_forward_backward_func) over megapipe's engine,
and the adapter that runs Megatron-Core GPTModel chunks as StageModules (McoreGPTStage)."""

from megapipe.megatron.forward_backward import get_forward_backward_func
from megapipe.megatron.mcore_adapter import McoreGPTStage

__all__ = ["McoreGPTStage", "get_forward_backward_func"]
