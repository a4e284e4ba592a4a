"""megapipe.overlap"""
