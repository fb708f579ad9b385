"""pdserve's wire API, Python stubs generated from ``protos/`` (``pdserve.v1``), and the
``pdserve`` command line (``pdserve.cli``)."""
