"""Helpers the tests share: rank pools, test cases run inside the ranks, toy models."""
