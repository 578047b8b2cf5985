"""CPU kernels chosen at run time: this project's AVX2/AVX-512 C++ ops and the blocked bf16 linear."""
