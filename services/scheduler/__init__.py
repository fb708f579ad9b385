"""The scheduler service: admission, placement and the worker registry (off the token path).

Modules: ``model`` (messages), ``policy`` (pure placement), ``state`` (the single-owner
loop), ``store`` (Redis), ``metrics`` (Prometheus), ``server`` (gRPC edge and process),
``config`` (flags and env). Run it with ``python -m services.scheduler``.
"""
