"""megapipe.moe"""
