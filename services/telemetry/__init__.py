"""Observability shared by every service: spans (`spans`), tracing setup and gRPC propagation
(`tracing`, `client_tracing`), Prometheus metrics (`metrics`), structured logs (`logs`), and
the per-process entry point that sets them all up (`process`)."""
