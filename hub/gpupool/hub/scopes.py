"""gpupool's JupyterHub scopes, named once.

Vocabulary
- ``custom:gpupool:jobs`` (:data:`JOBS_SCOPE`): submit, list, read the logs of and cancel one's
  own jobs; see one's own allocations. Every user holds it (the ``user`` role), and so does their
  server's token (the ``server`` role).
- ``custom:gpupool:admin`` (:data:`ADMIN_SCOPE`): see and cancel everyone's jobs and
  allocations, the admin page. Held by JupyterHub's admin users (the ``gpupool-admin`` role).

Contract: custom scopes exist only once JupyterHub has loaded its config, so handlers check them
at request time against ``expanded_scopes``, never with ``@needs_scope`` at import.
"""

from __future__ import annotations

JOBS_SCOPE = "custom:gpupool:jobs"
ADMIN_SCOPE = "custom:gpupool:admin"

CUSTOM_SCOPES = {
    JOBS_SCOPE: {"description": "Submit, list, read logs of and cancel your own GPU jobs."},
    ADMIN_SCOPE: {"description": "See and cancel everyone's GPU jobs.", "subscopes": [JOBS_SCOPE]},
}
"""For ``c.JupyterHub.custom_scopes``."""

SERVER_ROLE_SCOPES = [JOBS_SCOPE]
"""What gpupool adds to JupyterHub's ``server`` role, whose scopes every server's token gets:
the owner's own jobs. Never the admin scope: code running in an admin's notebook does not act
on everyone's jobs (the admin page and the admin's own tokens do)."""
