"""The C++ CPU kernels (csrc/) and the builder that loads them as torch ops."""
