"""Precision: the dtype policy of a run (storage dtype per part, autocast dtype) and the
low-bit frozen weights (fp8 storage, weight-only quantization backends)."""
