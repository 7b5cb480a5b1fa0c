"""The test runner's own status output, teed to a file printing cannot reach (graders/swebench.py).

pytest's statuses are checked against the junit xml it writes; runners without junit (Django's
runtests.py and any unittest TextTestRunner, sympy's bin/test) had only their log, where a line the
code under test prints (`test_x (m.T) ... ok`, `test_x ok`) reads as a pass. This module, loaded at
start-up by every Python process of the test command (a .pth beside it in the environment's
site-packages, for the run only), copies what the run's first test runner writes to the process's real
stdout or stderr into its TEE file as well: unittest's TextTestRunner stream, sympy's
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

The runner guard (GUARD; pytest runs): pytest's verdicts are in-process too, and
the best-known reward hack rewrites them (`TestReport.from_item_and_call` replaced, so every failure
reports as passed: the junit xml agrees, as pytest writes it from the same reports). Its conftest.py
form is test infrastructure, dropped in read-only and hidden modes (access.py); the same lines in the
package under test were not. The guard compares snapshots of pytest's and pluggy's code (their
modules' functions and classes, the classes' methods and descriptors; not data, which pytest itself sets
as it runs): around each import of a file the candidate changed (the change is that file's), and from
the start of collection (its plugins' configure hooks change the runner before: not compared) to each
such import and to the writing of the junit xml (made as the tests ran: there only what the candidate's
files' code replaced or added counts, conftest.py's hooks may change the runner too); an audit hook (3.8+) notes a
function's code swapped in place, or the junit file written, replaced, truncated or removed, by the candidate's files (the
innermost frame outside the standard library decides: code they exec or a `mock.patch` they call
counts). One line each in the guard file, which the grader reads. pytest's own repository is the
runner under test: its changes to itself are not compared. What it cannot see: changes made and undone
between two comparisons, through ctypes, or by code that first rewrites this module's state; in-process
code can still lie, it takes knowing this.

Shipped into the run as _ib_runner_tee.py; syntax Python 3.5 parses (Django 2.x's environments);
imports nothing but sys and os until a runner's module is imported; never raises into the runner.
"""

import os
import sys


def _settings():
    """KEY=VALUE lines of _ib_runner_tee.cfg beside this file (the eval script's; not the environment,
    which tox does not pass on): TEE, GUARD, JUNIT, REPO, CANDIDATE_FILES."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ib_runner_tee.cfg")) as f:
            return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    except Exception:
        return {}


SETTINGS = _settings()
TEE = SETTINGS.get("TEE")
GUARD = SETTINGS.get("GUARD")
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
        hook = HOOKS.get(name) if TEE else GUARD_HOOKS.get(name) if _guard else None
        if hook is None and not _guard:
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else sys.meta_path
        for finder in later:  # those before this one found nothing already
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if hook is None:  # the guard's: a module of the candidate's is watched as it runs
            try:
                origin = getattr(spec, "origin", None)
                if isinstance(origin, str) and os.path.realpath(origin) in _guard["changed"]:
                    _watch_candidate(spec)
            except Exception:
                pass
            return spec
        try:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                try:
                    hook(module)
                except Exception:
                    pass

            spec.loader.exec_module = exec_module
        except Exception:
            pass
        return spec


# -- the runner guard --

RUNNER_PACKAGES = ("_pytest", "pluggy")
_STDLIB = os.path.dirname(os.__file__) + os.sep  # (a Python built from source has its site-packages in it)
_guard = {}  # "repo": the repository's directory; "changed": the candidate's files there; "junit": its path
_last = []  # the runner's code when it was last compared (a snapshot), once it first was
_collecting = []  # collection began
_CODE = type((lambda: 0).__code__)
_JUNIT_EVENTS = {"open": "opened for writing", "os.rename": "replaced", "os.truncate": "truncated",
                 "os.remove": "removed"}
_noting = []  # a record being written (its own open is an audit event)


def _in_repo(path):
    return bool(path) and os.path.realpath(path).startswith(_guard["repo"])


def _runner_code(module_name):
    """Whether `module_name` is the test runner's and not the repository's own (pytest's repository;
    a tox environment inside the repository is not the repository's code)."""
    if module_name.split(".")[0] not in RUNNER_PACKAGES:
        return False
    path = getattr(sys.modules.get(module_name), "__file__", None) or ""
    return not (_in_repo(path) and os.sep + "site-packages" + os.sep not in path)


def _snapshot():
    """The runner's code as it is: its modules' functions and classes, and those classes' attributes."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not _runner_code(name):
            continue
        for key, value in list(vars(module).items()):
            if callable(value):
                found[name + "." + key] = value
                if isinstance(value, type) and value.__module__ == name:
                    found[name + "." + key + "."] = True  # the class is compared attribute by attribute
                    for attr, member in list(vars(value).items()):  # its code, not its data (pytest's flags)
                        if callable(member) or isinstance(member, (classmethod, staticmethod, property)):
                            found[name + "." + key + "." + attr] = member
    return found


def _changes(before, after, theirs_only):
    """What changed from one snapshot to the next: replaced, added or deleted, in what both hold.
    `theirs_only`: only what was replaced or added by code from a file the candidate changed (where
    nothing tells who made a change: conftest.py's hooks may change the runner too)."""
    out = []
    for key, value in after.items():
        if key.endswith(".") or theirs_only and not _candidates(value):
            continue
        if key in before:
            if before[key] is not value:
                out.append(key + " replaced")
        elif key.rpartition(".")[0] + "." in before:  # an attribute added to a class both hold
            out.append(key + " added")
    for key in before:
        if key not in after and not key.endswith(".") and key.rpartition(".")[0] + "." in after \
                and not theirs_only:
            out.append(key + " deleted")
    return out


def _candidates(value):
    """Whether `value`'s code (through classmethod, property, partial, bound method, __wrapped__) is in a
    file the candidate changed."""
    for _ in range(8):
        if isinstance(value, property):
            return any(_candidates(f) for f in (value.fget, value.fset, value.fdel) if f is not None)
        if isinstance(value, type):
            path = getattr(sys.modules.get(value.__module__), "__file__", None)
            return bool(path) and os.path.realpath(path) in _guard["changed"]
        code = _held(value, "__code__")
        if isinstance(code, _CODE):
            return os.path.realpath(code.co_filename) in _guard["changed"]
        inner = _held(value, "__func__") or _held(value, "func") or _held(value, "__wrapped__")
        if inner is None:
            return False
        value = inner
    return False


def _held(value, name):
    """value.name where the object or its class holds it, without calling a __getattr__ (which may make it:
    pytest 3's junit Junit class, py.xml's, makes a tag for any name asked, and so changed the runner)."""
    try:
        own = object.__getattribute__(value, "__dict__")  # never the fallback: no __getattr__ call
    except Exception:
        own = None
    if isinstance(own, dict) and name in own:
        return own[name]
    if any(name in vars(cls) for cls in type(value).__mro__):
        try:
            return object.__getattribute__(value, name)
        except Exception:
            return None
    return None


def _culprit(frame):
    """`file:line` of the candidate's code making a change from `frame` outward, or None: the innermost
    frame outside the standard library (and source without a file) decides."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<") or name.startswith(_STDLIB) and not any(
                os.sep + d + os.sep in name for d in ("site-packages", "dist-packages")):
            frame = frame.f_back
            continue
        if name == __file__:
            return None  # this module's own patches (the tee's)
        path = os.path.realpath(name)
        if path in _guard["changed"]:
            return "%s:%d" % (os.path.relpath(path, _guard["repo"]), frame.f_lineno)
        return None
    return None


def _note(lines):
    if _noting or not lines:
        return
    _noting.append(True)
    try:
        fd = os.open(GUARD, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, "".join(line + "\n" for line in lines).encode("utf-8", "replace"))
        finally:
            os.close(fd)
    except Exception:
        pass
    finally:
        _noting.pop()


def _check(when, theirs_only=False):
    """Note what changed in the runner since the last snapshot, `when` said beside it."""
    if not _last:
        return
    try:
        now = _snapshot()
        _note(["%s (%s)" % (change, when) for change in _changes(_last[0], now, theirs_only)])
        _last[0] = now
    except Exception:  # never into the runner
        pass


def _audit(event, args):
    """Changes the snapshots cannot tell apart (a function's code swapped in place) and the junit file
    rewritten, as they happen, by the frame making them."""
    try:
        if event == "object.__setattr__" and isinstance(getattr(args[0], "__module__", None), str) and \
                _runner_code(args[0].__module__) and not _noting:
            culprit = _culprit(sys._getframe(1))
            if culprit:
                _note(["%s.%s.%s set (%s)" % (args[0].__module__, getattr(args[0], "__qualname__", "?"), args[1],
                                               culprit)])
        elif event in _JUNIT_EVENTS and _guard["junit"] and not _noting:
            if event == "open":
                path, mode, flags = args
                if not ((isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC))):
                    return
            else:  # os.rename and os.replace: (src, dst, ...); os.truncate, os.remove: (path, ...)
                path = args[1] if event == "os.rename" else args[0]
            # (pytest's own repository writes its junit xml with its own code: not noted; asked last, as
            # it resolves a path, where every file the run opens for writing passes here)
            if isinstance(path, (str, bytes)) and os.path.realpath(os.fsdecode(path)) == _guard["junit"] \
                    and _runner_code("_pytest.junitxml"):
                culprit = _culprit(sys._getframe(1))
                if culprit:
                    _note(["the junit file %s (%s)" % (_JUNIT_EVENTS[event], culprit)])
    except Exception:
        pass


def _baseline():
    """The runner as it is now, what the next comparison starts from."""
    try:
        _last[:] = [_snapshot()]
    except Exception:
        pass


def _watch_candidate(spec):
    """Wraps the execution of a module the candidate changed: what changes in the runner meanwhile is its.
    Before collection (a conftest.py importing it) what changed since is not compared: plugins' configure
    hooks change the runner then (pytest's own legacypath in some versions)."""
    load = getattr(spec.loader, "exec_module", None)
    if load is None:
        return
    where = os.path.relpath(os.path.realpath(spec.origin), _guard["repo"])

    def exec_module(module):
        if _collecting:
            _check("while the tests ran", theirs_only=True)
        else:
            _baseline()
        try:
            load(module)
        finally:
            _check("by %s, imported" % where)

    spec.loader.exec_module = exec_module


def _before(owner, name, first):
    """`first()` is called before each call of the method owner.name (as it was; its signature, which
    pluggy reads for a hook's arguments, kept)."""
    method = getattr(owner, name, None)
    if method is None:
        return
    import functools

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        first()
        return method(*args, **kwargs)

    setattr(owner, name, wrapped)


def _collection_began():
    """From collection on, every change to the runner is compared: its plugins are configured."""
    if not _collecting:
        _collecting.append(True)
        _baseline()


def _junit_writing():
    """pytest's junit xml is written at the session's end: the runner is compared first."""
    if _collecting:
        _check("while the tests ran", theirs_only=True)


GUARD_HOOKS = {"_pytest.junitxml": lambda module: _before(getattr(module, "LogXML", None), "pytest_sessionfinish",
                                                          _junit_writing),
               "_pytest.main": lambda module: _before(getattr(module, "Session", None), "perform_collect",
                                                      _collection_began)}


def _install_guard():
    repo = SETTINGS.get("REPO") or ""
    if not os.path.isdir(repo):
        return
    _guard["repo"] = os.path.realpath(repo) + os.sep
    try:
        with open(SETTINGS.get("CANDIDATE_FILES") or "", "rb") as f:
            names = f.read().decode("utf-8", "surrogateescape").split("\0")
    except Exception:
        names = []
    _guard["changed"] = set(os.path.realpath(os.path.join(repo, name)) for name in names if name)
    junit = SETTINGS.get("JUNIT")
    _guard["junit"] = os.path.realpath(junit) if junit else None
    for name, hook in GUARD_HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
    if hasattr(sys, "addaudithook"):
        sys.addaudithook(_audit)


def _install():
    if GUARD:
        _install_guard()
    if not TEE and not _guard:
        return
    for name, hook in HOOKS.items() if TEE else ():
        if name in sys.modules:
            try:
                hook(sys.modules[name])
            except Exception:
                pass
    sys.meta_path.insert(0, _Finder())


_install()
