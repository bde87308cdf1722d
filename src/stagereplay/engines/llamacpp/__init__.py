"""The llamacpp engine: llama.cpp's binding and what both llama.cpp engines share."""
