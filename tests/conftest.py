"""Loaded before every test module: ``pdserve`` sets gRPC's fork support before ``grpc``
loads (the tests start services with ``subprocess.Popen``; see ``pdserve/__init__.py``)."""

import pdserve  # noqa: F401
