"""vlmspec evaluation: benchmarks and the lmms-eval plugin."""
