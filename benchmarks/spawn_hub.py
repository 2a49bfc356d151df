"""A spawner for the spawn benchmark only: users named ``plain…`` get JupyterHub's own
``SimpleLocalProcessSpawner``, everyone else ``LocalGPUSpawner``, so both run in one hub, behind
one proxy, with the same ``c.Spawner`` settings.
"""

from __future__ import annotations

from typing import Any

from jupyterhub.spawner import SimpleLocalProcessSpawner

from gpupool_spawner.local import LocalGPUSpawner


class PerUserSpawner(LocalGPUSpawner):
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        user = kwargs.get("user")
        if user is not None and user.name.startswith("plain"):
            return SimpleLocalProcessSpawner(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)
