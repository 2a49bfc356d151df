# gpupool: the runnable LOCAL/DEV default. `make run` uses this file.
#
# It declares the GPU pool: offers (what users may pick), teams (JupyterHub groups) with quotas in
# GPU-equivalents (a whole GPU = 1; a MIG instance = its memory slots / 8, so 3g.40gb = 0.5 and
# 1g.10gb = 0.125), and where the GPUs come from. The JupyterHub part (spawner, proxy, users)
# arrives with the spawner issue; until then `make run` shows the pool this file describes.
c = get_config()  # noqa: F821  (injected by JupyterHub / traitlets)

# -- where the GPUs come from --------------------------------------------------------------------
# "nvml" reads this machine's GPUs through the NVIDIA driver. Without a driver (a laptop, CI) the
# pool falls back to a SIMULATED pool of 4x H100-80GB, the last two MIG-enabled; every page and
# log line says "simulated" then. Spec grammar: "NODE: COUNTx MODEL[, mig=N[:P+P…]][, nvlink=K]".
c.GPUPool.inventory = "nvml"
c.GPUPool.simulated_fallback = "local: 4x H100-80GB, mig=2, nvlink=2"

# -- offers: what users may pick -----------------------------------------------------------------
# kind "gpu": whole GPUs (max_count per request, optional model, nvlink=True for one NVLink island);
# kind "mig": one MIG instance; a name like "mig-3g.40gb" implies the kind and the profile.
c.GPUPool.offers = {
    "cpu": {"description": "CPU only"},
    "h100": {"model": "H100-80GB", "max_count": 2, "description": "Whole H100 80GB"},
    "mig-3g.40gb": {"model": "H100-80GB", "description": "Half an H100 (MIG 3g.40gb)"},
    "mig-1g.10gb": {"model": "H100-80GB", "description": "An eighth of an H100 (MIG 1g.10gb)"},
}

# -- teams: JupyterHub groups with quotas ----------------------------------------------------------
# guarantee: GPU-eq the team can always use while the pool has it; borrow_limit: how much more it
# may use while other teams leave theirs idle; user_cap: the most one member may hold; offers:
# what the team may request (default: all). Small on purpose, so a refusal is easy to see.
c.GPUPool.teams = {
    "vision": {
        "guarantee": 1.5,
        "borrow_limit": 0.5,
        "user_cap": 1,
        "offers": ["cpu", "h100", "mig-3g.40gb"],
    },
    "nlp": {"guarantee": 1, "user_cap": 0.5, "offers": ["cpu", "mig-3g.40gb", "mig-1g.10gb"]},
}
# Users in no team get only this (default: CPU only).
c.GPUPool.everyone = {"offers": ["cpu"]}

# Placement: "gpupool" (fragmentation-aware), "best-fit" or "first-fit".
c.GPUPool.policy = "gpupool"
# Allocations persist here and survive restarts (any SQLAlchemy URL).
c.GPUPool.db_url = "sqlite:///gpupool.sqlite"
