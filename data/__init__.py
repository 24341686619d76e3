"""Data sources for training."""
