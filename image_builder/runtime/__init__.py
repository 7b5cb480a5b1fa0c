"""Run commands in an instance's layers without Docker.

    session.py         the types every backend shares: InstanceLayers, Backend, Session
    execution.py       RunRequest, RunResult, Bind, Executor: what graders program against
    backends.py        detect_backend, doctor, open_session
    holder_session.py  kernel and userns sessions on the per-user mount holder
    sandbox.py         Sandbox: one root kept from command to command (an agent's)
    warm.py, zygote.py WarmPool: runs of one Python program cloned from a warm interpreter, each in a
                       root and pid namespace of its own (zygote.py: what a clone shares, and why a run
                       cannot leave state for the next)
    holder.py, mounts.py, cgroups.py, native/   the holder process and its primitives
    apptainer.py, extract.py                    the other two backends

May import: errors, pack, store. This file imports nothing when loaded: the holder
starts under `python -S` and loads only what it uses. The names below are kept for
scripts (`from image_builder.runtime import open_session`) and load on first use.
"""

_EXPORTS = {
    "Backend": "session", "InstanceLayers": "session", "Session": "session",
    "DoctorLine": "backends", "detect_backend": "backends", "doctor": "backends", "open_session": "backends",
    "Bind": "execution", "RunRequest": "execution", "RunResult": "execution",
    "RunnerError": "mounts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
