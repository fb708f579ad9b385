"""Loaded before every test module: ``pdserve`` sets gRPC's fork support before ``grpc``
loads (the tests start services with ``subprocess.Popen``; see ``pdserve/__init__.py``).

Services refuse to start without a cluster token: the whole session shares one (every
process a test starts inherits it), and this process's own internal clients
(``cluster_auth.channel``) carry it."""

import os
import secrets

import pdserve  # noqa: F401
from services.common import cluster_auth

if not os.environ.get("PDSERVE_CLUSTER_TOKEN_FILE"):
    os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_urlsafe(32))
    cluster_auth.install(
        cluster_auth.ClusterAuth(token=os.environ["PDSERVE_CLUSTER_TOKEN"]), "tests"
    )
