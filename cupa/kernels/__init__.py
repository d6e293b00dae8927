"""CUDA backends: one module per kernel family; ``registry`` lists them and their specializations."""
