"""The process's NVML session: NVML initialised once and shared by every reader.

Vocabulary
- *nvml*: the ``pynvml`` module, or an object with its calls and errors (a
  :class:`~gpupool.discovery.simulated.SimulatedNVML` view, bound to one node as ``pynvml`` is
  bound to one host).
- *session*: :class:`NVMLSession`, the one object per nvml in this process
  (:meth:`NVMLSession.of`); it alone calls ``nvmlInit`` and ``nvmlShutdown``.
- *hold*: a reader's claim on the session. ``with session.use():`` holds it for a block (a
  one-off reading: discovery, a MIG instance made or destroyed); :meth:`NVMLSession.hold` until
  :meth:`NVMLSession.release` holds it for longer: a periodic reader
  (:class:`gpupool.monitors.activity.DeviceMonitor`, which the device and share watches read
  through) holds it from its first reading until it is closed, so sampling never
  re-initialises NVML.
- *handle*: NVML's ``c_nvmlDevice_t``, taken here only (:meth:`NVMLSession.device`,
  :meth:`NVMLSession.device_at`); handles derived from one (MIG devices, GPU instances) are
  taken from it by the reader.

Contract: NVML is initialised when the first hold begins and shut down when the last ends (NVML
counts ``nvmlInit`` per process the same way); ``session.nvml`` and handles outside a hold raise
``NVMLError_Uninitialized``, as NVML does after the last ``nvmlShutdown`` (a handle taken in an
earlier hold may be stale). An NVML that cannot start raises :class:`NVMLUnavailable`: the
sentence gpupool shows, still an ``NVMLError`` carrying NVML's code, so callers that handle
NVML's errors handle it too. Errors of single calls are NVML's own (``NotFound``, ``InUse``,
``NoPermission``): each reader decides what they mean; :func:`nvml_error` and :func:`text` are
the one reading of an error's code and of an NVML string. Holds are thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pynvml

_NO_DRIVER = (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded)

_sessions: weakref.WeakValueDictionary[int, NVMLSession] = weakref.WeakValueDictionary()
_sessions_lock = threading.Lock()


def nvml_error(e: BaseException) -> int | None:
    """NVML's error code of ``e`` (``None``: not an NVML error)."""
    return getattr(e, "value", None) if isinstance(e, pynvml.NVMLError) else None


def text(value: str | bytes) -> str:
    """An NVML string (bytes from older bindings) as text."""
    return value.decode() if isinstance(value, bytes) else value


class NVMLUnavailable(pynvml.NVMLError):
    """NVML could not be started: ``str()`` says why in gpupool's words ("no NVIDIA driver
    found (Driver Not Loaded)"), ``value`` is NVML's error code."""

    def __new__(cls, value: int, why: str) -> NVMLUnavailable:
        made: NVMLUnavailable = pynvml.NVMLError.__new__(cls, value)
        return made

    def __init__(self, value: int, why: str) -> None:
        super().__init__(value, why)
        self.why = why

    def __str__(self) -> str:
        return self.why

    @classmethod
    def because(cls, e: pynvml.NVMLError) -> NVMLUnavailable:
        what = "no NVIDIA driver found" if isinstance(e, _NO_DRIVER) else "could not start"
        return cls(int(e.value), f"{what} ({e})")


class NVMLSession:
    """One nvml's use by this process (see the module docstring); get it with :meth:`of`."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._holds = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, nvml: Any = None) -> NVMLSession:
        """The session of ``nvml`` (default: the real ``pynvml``): the same object for every
        reader while any of them keeps it."""
        nvml = pynvml if nvml is None else nvml
        with _sessions_lock:
            session = _sessions.get(id(nvml))
            if session is None:  # it keeps ``nvml`` alive, so the id names no other one meanwhile
                session = cls(nvml)
                _sessions[id(nvml)] = session
            return session

    @property
    def held(self) -> bool:
        return self._holds > 0

    @property
    def module(self) -> Any:
        """The nvml itself, held or not: for what is no NVML call (``simulated``, ``node_name``)."""
        return self._nvml

    @property
    def nvml(self) -> Any:
        """The nvml to call; ``NVMLError_Uninitialized`` outside a hold."""
        if not self._holds:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return self._nvml

    def hold(self) -> None:
        """Hold the session, initialising NVML if no one holds it; :class:`NVMLUnavailable` when
        NVML cannot start (nothing is held then)."""
        with self._lock:
            if self._holds == 0:
                try:
                    self._nvml.nvmlInit()
                except pynvml.NVMLError as e:
                    raise NVMLUnavailable.because(e) from e
            self._holds += 1

    def release(self) -> None:
        """End one hold; the last shuts NVML down (its handles are invalid from then on)."""
        with self._lock:
            if self._holds == 0:
                raise RuntimeError("NVMLSession.release() without a hold")
            self._holds -= 1
            if self._holds == 0:
                with contextlib.suppress(pynvml.NVMLError):
                    self._nvml.nvmlShutdown()

    @contextlib.contextmanager
    def use(self) -> Iterator[NVMLSession]:
        """Hold the session for a block."""
        self.hold()
        try:
            yield self
        finally:
            self.release()

    def device(self, uuid: str) -> Any:
        """The handle of a GPU or MIG device by UUID (``NVMLError_NotFound``: none such)."""
        return self.nvml.nvmlDeviceGetHandleByUUID(uuid)

    def device_at(self, index: int) -> Any:
        """The handle of the GPU at NVML index ``index``."""
        return self.nvml.nvmlDeviceGetHandleByIndex(index)
