"""Tracing (OpenTelemetry) helpers shared by every service."""
