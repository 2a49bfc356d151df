"""gpupool's IPython startup file: caps PyTorch at this kernel's GPU share, if it has one.

IPython runs it at every kernel start: a local server's share gets ``PYTHONSTARTUP`` pointing
here (the local spawner sets it), and the notebook image installs a copy as
``<sys.prefix>/etc/ipython/startup/50-gpupool-share-cap.py``. It leaves no name in the user's
namespace, prints nothing and never fails the kernel (see :mod:`gpupool_lab.share_cap`).
"""

try:  # noqa: SIM105 - no name (contextlib) left in the user's namespace
    __import__("gpupool_lab.share_cap", fromlist=["install"]).install()
except Exception:  # a kernel always starts, share or not
    pass
