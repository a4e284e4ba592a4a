"""megapipe.models"""
