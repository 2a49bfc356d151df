"""gpupool's JupyterHub spawners: ``LocalGPUSpawner`` (``gpupool-local``) and ``KubeGPUSpawner``
(``gpupool-kube``), both built on JupyterHub's own spawners with :class:`GPUSpawnerMixin`.

Import the classes from their modules (``gpupool_spawner.local``, ``gpupool_spawner.kube``) so
that the local spawner does not pull in the Kubernetes client.
"""

from gpupool_spawner.mixin import GPUSpawnerMixin
from gpupool_spawner.options import parse_user_options

__all__ = ["GPUSpawnerMixin", "parse_user_options"]
