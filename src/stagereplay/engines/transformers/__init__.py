"""The transformers engine: transformers' engine."""
