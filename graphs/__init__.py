"""CUDA-graph sizing and capture policy for the speculative block."""
