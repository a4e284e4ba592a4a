"""megapipe.megatron: Megatron's front end (get_forward_backward_func) over megapipe's engine."""

from megapipe.megatron.forward_backward import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
