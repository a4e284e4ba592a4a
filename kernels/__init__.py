"""megapipe.kernels: token permute/unpermute kernels (Triton) with a plain-torch reference."""
