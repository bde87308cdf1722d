"""The llamaserver engine: llama.cpp's own HTTP server."""
