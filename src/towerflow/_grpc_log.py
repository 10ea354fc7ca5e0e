"""gRPC's C core logs at ERROR unless the user asks for more.

gRPC's C core writes to stderr at INFO by default (e.g. ``Got goaway`` when a
peer closes a connection); towerflow's own log says what matters. Imported by
``towerflow/__init__.py`` before any module loads gRPC; ``GRPC_VERBOSITY``
set by the user (``DEBUG``, ``INFO``) wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
