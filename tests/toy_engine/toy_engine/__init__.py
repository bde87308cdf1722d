"""A fourth engine for tests/test_toy_engine.py: transformers under another name, plugged in from outside
src/ through the registry's entry point group."""
