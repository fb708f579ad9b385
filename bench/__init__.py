"""pdserve's benchmarks. ``pdserve`` is imported first: it sets gRPC's fork support before
``grpc`` loads (see ``pdserve/__init__.py``)."""

import pdserve  # noqa: F401
