"""megapipe.parallel"""
