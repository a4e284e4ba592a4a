"""megapipe.runtime"""
