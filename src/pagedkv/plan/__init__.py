"""Capacity planning (``pagedkv plan``): model shapes, a catalog of models and devices, and the
paged-versus-contiguous concurrency a memory budget allows. Imports no torch."""
