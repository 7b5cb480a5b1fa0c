"""The test runner's own status output, teed to a file printing cannot reach (graders/swebench.py).

pytest's statuses are checked against the junit xml it writes; runners without junit (Django's
runtests.py and any unittest TextTestRunner, sympy's bin/test) had only their log, where a line the
code under test prints (`test_x (m.T) ... ok`, `test_x ok`) reads as a pass. This module, loaded at
start-up by every Python process of the test command (a .pth beside it in the environment's
site-packages, for the run only), copies what the run's first test runner writes to the process's real
stdout or stderr into IMAGE_BUILDER_RUNNER_TEE as well: unittest's TextTestRunner stream, sympy's
PyTestReporter.write. Code under test that prints, to any stream or descriptor, adds nothing to that
copy; the grader reads the copy with the same parser and fails a test the log says passed and the
copy does not.

Which runner: the first one, over all the run's processes, whose output goes to the real stdout or
stderr (the file is made with O_EXCL): Django's runner in runtests.py, sympy's in the child
process bin/test starts. Runners that tests start themselves, in-process into a buffer or in a
subprocess of their own, are not copied, as their output is not in the log either.

What it cannot stop: code under test that, in the runner's process, writes to the copy itself
(the file is the process's to open, as the junit file is), or replaces the runner's methods; as
with junit, in-process code can lie to in-process reporters. Without this module loaded (another
interpreter, `python -S`), or when no runner's output reaches stdout or stderr, nothing is copied and
the grader reads the log alone, as before.

Shipped into the run as _ib_runner_tee.py; syntax Python 3.5 parses (Django 2.x's environments);
imports nothing but sys and os until a runner's module is imported; never raises into the runner.
"""

import os
import sys

TEE = os.environ.get("IMAGE_BUILDER_RUNNER_TEE")
_owner = []  # the runner whose output is copied (in this process), once claimed
_copy = []  # its file's descriptor
_inside = []  # a PyTestReporter.write in progress (it calls itself)


def _claim(runner):
    """True if `runner` is the run's copied one: the first to ask, over every process of the run."""
    if _owner:
        return _owner[0] is runner
    try:  # the file is the claim: made once, by its first runner. A bare descriptor, not a file object:
        # one left open at exit is a ResourceWarning on stderr, in the log, where a runner enables warnings
        _copy.append(os.open(TEE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600))
    except Exception:
        _owner.append(None)  # another process's runner is the one: none of this process
        return False
    _owner.append(runner)
    return True


def _real(stream):
    return stream is not None and (stream is sys.__stdout__ or stream is sys.__stderr__)


class _Tee(object):
    """A stream that also writes to the copy; everything else is the stream's."""

    def __init__(self, stream):
        self._ib_stream = stream

    def write(self, text):
        written = self._ib_stream.write(text)
        try:
            data = text.encode("utf-8", "replace") if isinstance(text, str) else bytes(text)
            while data:
                data = data[os.write(_copy[0], data):]
        except Exception:
            pass
        return written

    def __getattr__(self, name):
        return getattr(self._ib_stream, name)


def _hook_unittest(module):
    runner = module.TextTestRunner
    init = runner.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            stream = getattr(self.stream, "stream", None)  # inside unittest's _WritelnDecorator
            if _real(stream) and _claim(self):
                self.stream = module._WritelnDecorator(_Tee(stream))
        except Exception:
            pass

    runner.__init__ = __init__


def _hook_sympy(module):
    reporter = getattr(module, "PyTestReporter", None)
    if reporter is None or not callable(getattr(reporter, "write", None)):
        return
    write = reporter.write

    def tee_write(self, *args, **kwargs):
        # It writes through sys.stdout.write: sys.stdout is the copying stream while it does.
        if _inside or not _real(sys.stdout) or not _claim(self):
            return write(self, *args, **kwargs)
        saved = sys.stdout
        _inside.append(True)
        sys.stdout = _Tee(saved)
        try:
            return write(self, *args, **kwargs)
        finally:
            sys.stdout = saved
            _inside.pop()

    reporter.write = tee_write


HOOKS = {"unittest.runner": _hook_unittest, "sympy.testing.runtests": _hook_sympy,
         "sympy.utilities.runtests": _hook_sympy}


class _Finder(object):
    """Patches the runners' modules as they are imported (the import system's own loaders load them)."""

    def find_spec(self, name, path=None, target=None):
        if name not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        try:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                try:
                    HOOKS[name](module)
                except Exception:
                    pass

            spec.loader.exec_module = exec_module
        except Exception:
            pass
        return spec


def _install():
    if not TEE:
        return
    for name, hook in HOOKS.items():
        if name in sys.modules:
            try:
                hook(sys.modules[name])
            except Exception:
                pass
    sys.meta_path.insert(0, _Finder())


_install()
