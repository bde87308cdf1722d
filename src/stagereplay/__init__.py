"""stagereplay: audit stage-replay divergence between live KV caches and prefill."""

__version__ = "0.1.0"
