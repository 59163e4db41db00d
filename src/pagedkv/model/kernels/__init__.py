"""The model runner's own CPU kernels, in C, built at first use with the system C compiler
(:mod:`pagedkv.model.kernels.cpu_quant`: weight-only int4 / int8 products for small steps;
products, dequantization and row lookup on GGUF blocks as the file stores them)."""
