"""Structured outputs: request parameters, the `structured_output` backend protocol, the core's manager."""
