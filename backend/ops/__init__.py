"""Device operations: linears by quantization format, CPU matmul, CUDA graphs, attention backends."""
