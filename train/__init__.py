"""Training entry points and the CPU adaptations they apply."""
