"""megapipe.schedule"""
