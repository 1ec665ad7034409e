"""CPU emulation of every kernel op, written to match the kernels' arithmetic (the bit-exact reference)."""
