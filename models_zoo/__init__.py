"""Networks used by fxplan benchmarks, tests and CLI."""
