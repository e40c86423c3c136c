"""What an operator of the always-on service uses: Prometheus metrics, readable logs, one-line start errors and a
finished run's summary (docs/operate.md)."""
