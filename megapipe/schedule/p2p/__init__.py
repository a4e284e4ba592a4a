"""Where sends and receives go (lowering), the proof that they finish, the early sends."""
