"""pdserve's wire API: Python stubs generated from ``protos/`` (see ``pdserve.v1``)."""
