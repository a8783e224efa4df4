"""Benchmarks: datasets, a Hugging Face reference and the throughput benchmark."""
