"""Graph builders for model families."""
