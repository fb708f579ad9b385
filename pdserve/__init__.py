"""pdserve's wire API, Python stubs generated from ``protos/`` (``pdserve.v1``), and the
``pdserve`` command line (``pdserve.cli``).

Importing it turns grpcio's fork support off unless the environment says otherwise, so it
must happen before ``grpc`` loads (``services``, ``bench`` and the tests import it first).
With it on (grpcio's default), a child that ``subprocess.Popen`` forks restarts gRPC's
poller after Popen has closed the child's inherited descriptors, and can abort before its
``exec`` (grpc/grpc#43055): a worker that ``pdserve up`` or a test starts then dies at birth.
pdserve never uses a gRPC object across a fork: every child it forks execs at once.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
