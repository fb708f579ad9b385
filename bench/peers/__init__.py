"""Other serving systems, built and started only by benchmarks (never by tests or CI)."""
