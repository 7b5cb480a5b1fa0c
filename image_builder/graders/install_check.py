"""What an evaluation's install changed beyond the project's own installed files (graders/swebench.py).

SWE-bench's eval script runs the spec's install again after the candidate patch (`pip install -e .`,
`python setup.py install`): a patch to setup.py, to a compiled extension's sources or, for an install
that copies the package, to any of its files, is tested as installed. That install runs the candidate's
setup.py or build backend before the test runner starts, as the user the tests run as: it could rewrite
pytest on disk, add a .pth that patches it at every interpreter's start, or declare a pytest plugin, and
runner_tee.py's guard, which watches what the candidate's files do in the runner's process, would not
see it. This module, shipped into the run and started there before the install as
`python -I -S install_check.py WORKDIR RUNNER`, reads the run's nonce on stdin, takes stock, says
`ready`, waits for the nonce again, and prints it with a JSON list of what changed meanwhile that the
project's own install may not change:
  - the standard library; the interpreters and test runners of the bin folders (python*, pytest*,
    tox*, RUNNER: the test command's first word) but the project's own scripts; any file or entry of
    the site-packages folders (the user's too) but the project's own: its .egg-link pointing into
    WORKDIR, the distribution whose direct_url.json names WORKDIR and the files its RECORD lists, an
    .egg or .egg-info whose top-level packages are all in WORKDIR, and later versions of those (the
    name before the first '-'). Which entries are the project's is decided before the install, from
    what the environment's own install left, so a candidate's setup.py cannot claim pytest's;
  - a .pth file's import lines no .pth had before (run at every interpreter's start; one that only moved
    to a file of another name runs what ran before). Path lines are free (they come after site-packages
    on sys.path and shadow nothing installed), but in a .pth with import lines, old setuptools'
    easy-install.pth, whose lines move its paths to the front, only the project's eggs;
  - the pytest plugins the distributions declare (entry point group pytest11), WORKDIR's egg-info too.
A file counts as changed when its ctime or size moved (ctime cannot be set back, unlike mtime). The
stock is held in this process, started before the install, not re-read from a file the install could
rewrite, nor compared by an interpreter it could have replaced. What it cannot see: a process the
install leaves running (the tests' own code can start one too), or one that ptraces this process.

Stdlib only; Python 3.5 syntax (Django 2.2's environments).
"""

import json
import os
import site
from stat import S_ISDIR as stat_is_dir
import sys
import sysconfig
import zipfile

DIST_SUFFIXES = (".dist-info", ".egg-info", ".egg", ".egg-link")


def dist_name(entry):
    """`Django-2.2.dev0-py3.5.egg` -> `django`; `__editable__.foo_bar-1.0.pth` -> `foo_bar`."""
    name = entry[len("__editable__."):] if entry.startswith("__editable__.") else entry
    name = name.split("-")[0]
    for suffix in DIST_SUFFIXES + (".pth", ".py"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name.lower().replace("-", "_").replace(".", "_")


def read(path, limit=1 << 22):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def under(path, root):
    path = os.path.realpath(path)
    return path == root or path.startswith(root + os.sep)


def site_dirs():
    """The interpreter's site-packages folders and the user's. Under -S, site has not read a venv's
    pyvenv.cfg, so its folder is found here, as site.venv() finds it."""
    prefixes = [sys.prefix, sys.exec_prefix]
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for folder in (exe_dir, os.path.dirname(exe_dir)):
        if os.path.isfile(os.path.join(folder, "pyvenv.cfg")):
            prefixes.insert(0, folder)
            break
    dirs = list(site.getsitepackages(prefixes))
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    out = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def bin_dirs():
    dirs = [os.path.dirname(sys.executable), sysconfig.get_paths().get("scripts", ""), "/usr/local/bin"]
    out = []
    for d in dirs:
        if d and os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def in_workdir(names, workdir):
    for name in names:
        if not any(os.path.exists(os.path.join(workdir, sub, name + ext))
                   for sub in ("", "src", "lib") for ext in ("", ".py")):
            return False
    return bool(names)


def own_entries(sites, workdir):
    """The project's installed entries (site-packages names, bin file names) and its distributions' names."""
    entries, scripts, names = set(), set(), set()
    for d in sites:
        try:
            listing = os.listdir(d)
        except OSError:
            continue
        for entry in listing:
            path = os.path.join(d, entry)
            mine = False
            if entry.endswith(".egg-link"):
                first = (read(path) or "").splitlines()[:1]
                mine = bool(first) and under(first[0].strip(), workdir)
                if mine:  # `setup.py develop`: the metadata, scripts named there, is in the checkout
                    target = os.path.join(d, first[0].strip())
                    for info in os.listdir(target) if os.path.isdir(target) else ():
                        if info.endswith(".egg-info"):
                            scripts.update(scripts_of(os.path.join(target, info)))
            elif entry.endswith(".dist-info"):
                try:
                    url = json.loads(read(os.path.join(path, "direct_url.json")) or "{}").get("url", "")
                except (ValueError, AttributeError):
                    url = ""
                mine = isinstance(url, str) and url.startswith("file://") and under(url[len("file://"):], workdir)
                if mine:
                    for line in (read(os.path.join(path, "RECORD")) or "").splitlines():
                        top = line.rsplit(",", 2)[0]
                        if top.startswith(".."):
                            scripts.add(os.path.basename(top))
                        elif top:
                            entries.add(top.split("/")[0])
            elif entry.endswith((".egg", ".egg-info")):
                info = os.path.join(path, "EGG-INFO") if entry.endswith(".egg") else path
                if os.path.isfile(path):  # a zipped egg (`setup.py install` of a zip-safe package)
                    tops, egg_scripts = zipped_egg(path)
                else:
                    tops = [t.strip() for t in (read(os.path.join(info, "top_level.txt")) or "").splitlines()
                            if t.strip()]
                    egg_scripts = scripts_of(info)
                mine = in_workdir(tops, workdir)
                if mine:
                    entries.update(tops)
                    entries.update(t + ".py" for t in tops)
                    scripts.update(egg_scripts)
            if mine:
                entries.add(entry)
                names.add(dist_name(entry))
    return entries, scripts, names


def zipped_egg(path):
    """A zipped egg's top-level names and scripts (as scripts_of reads a folder's)."""
    try:
        with zipfile.ZipFile(path) as egg:
            def text(name):
                try:
                    return egg.read("EGG-INFO/" + name).decode("utf-8", "replace")
                except KeyError:
                    return ""
            tops = [t.strip() for t in text("top_level.txt").splitlines() if t.strip()]
            names = {n[len("EGG-INFO/scripts/"):] for n in egg.namelist() if n.startswith("EGG-INFO/scripts/")}
            names.update(entry_points_in(text("entry_points.txt"), "console_scripts"))
            names.update(entry_points_in(text("entry_points.txt"), "gui_scripts"))
            return tops, names - {""}
    except (OSError, zipfile.BadZipFile):
        return [], set()


def scripts_of(info):
    """The bin files an egg's or egg-info's metadata names: its scripts and console/gui entry points."""
    folder = os.path.join(info, "scripts")
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    for group in ("console_scripts", "gui_scripts"):
        names.update(entry_points(os.path.join(info, "entry_points.txt"), group))
    return names


def entry_points(path, group):
    """The names of `group`'s entries in an entry_points.txt."""
    return entry_points_in(read(path) or "", group)


def entry_points_in(text, group):
    out, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]").strip()
        elif current == group and "=" in line:
            out.append(line.split("=", 1)[0].strip())
    return out


def plugins(sites, workdir):
    """Every pytest11 entry point (distribution folder, line) of the site folders and WORKDIR's metadata."""
    found = set()
    places = [os.path.join(d, e) for d in sites if os.path.isdir(d) for e in os.listdir(d)]
    for sub in ("", "src", "lib"):
        root = os.path.join(workdir, sub)
        if os.path.isdir(root):
            places += [os.path.join(root, e) for e in os.listdir(root)]
    for place in places:
        if place.endswith((".dist-info", ".egg-info", ".egg")):
            info = os.path.join(place, "EGG-INFO") if place.endswith(".egg") else place
            for name in entry_points(os.path.join(info, "entry_points.txt"), "pytest11"):
                found.add(os.path.basename(place).split("-")[0] + ": " + name)
    return found


def pth_lines(sites):
    """Every .pth file's lines: path -> (import lines, path lines)."""
    found = {}
    for d in sites:
        if os.path.isdir(d):
            for entry in os.listdir(d):
                if entry.endswith(".pth"):
                    lines = [l.strip() for l in (read(os.path.join(d, entry)) or "").splitlines()]
                    found[os.path.join(d, entry)] = (
                        {l for l in lines if l.startswith(("import ", "import\t"))},
                        {l for l in lines if l and not l.startswith(("#", "import ", "import\t"))})
    return found


def stat(path):
    """A file's (ctime, size); a folder's only that it is one (a file's copy-up in an overlay changes its
    folder's times; what is added to or removed from it is seen as the file itself)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return "folder" if stat_is_dir(st.st_mode) else (st.st_ctime_ns, st.st_size)


def walk(top, skip=()):
    """Every path under `top` (itself included), but folders named in `skip`."""
    yield top
    if os.path.islink(top) or not os.path.isdir(top):
        return
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in dirs + files:
            yield os.path.join(root, name)


# The bin files that start test runs: interpreters, pytest, tox, and the test command's own (its first
# word). Not every script: `setup.py install` (easy_install) rewrites the scripts of the dependencies it
# walks (django 2.2's: sqlparse's sqlformat), which start no test run.
RUNNERS = ("python", "pytest", "py.test", "tox")


class Stock:
    def __init__(self, workdir, runner=""):
        self.workdir = os.path.realpath(workdir)
        self.runner = runner
        self.sites, self.bins = site_dirs(), bin_dirs()
        self.own, self.scripts, self.names = own_entries(self.sites, self.workdir)
        self.files = self.protected()
        self.pth = pth_lines(self.sites)
        self.plugins = plugins(self.sites, self.workdir)

    def is_own(self, entry):
        """A site folder's entry the project's install may change (a .pth: only its import lines count)."""
        return (entry in self.own or entry.endswith(".pth")
                or entry.endswith(DIST_SUFFIXES) and dist_name(entry) in self.names)

    def protected(self):
        paths = {}
        paths_cfg = sysconfig.get_paths()
        for key in ("stdlib", "platstdlib"):
            root = paths_cfg.get(key)
            if root and os.path.isdir(root):
                for path in walk(root, skip=("site-packages", "dist-packages")):
                    paths[path] = stat(path)
        for d in self.sites:
            paths[d] = ("exists", os.path.isdir(d))
            if not os.path.isdir(d):
                continue
            for entry in os.listdir(d):
                if self.is_own(entry):
                    continue
                for path in walk(os.path.join(d, entry)):
                    # the bytecode of the project's own top-level modules (pip compiles what it installs)
                    if entry != "__pycache__" or os.path.basename(path).split(".")[0] + ".py" not in self.own:
                        paths[path] = stat(path)
        for d in self.bins:
            for entry in os.listdir(d):
                if entry not in self.scripts and (entry.startswith(RUNNERS) or entry == self.runner):
                    paths[os.path.join(d, entry)] = stat(os.path.join(d, entry))
        return paths

    def changes(self):
        out = []
        now = self.protected()
        for path in sorted(set(self.files) | set(now)):
            if self.files.get(path) != now.get(path):
                what = "added" if path not in self.files else "removed" if path not in now else "changed"
                out.append("the install " + what + " " + path)
        # An import line some .pth had before is not new code wherever it moves: setuptools names a
        # namespace package's -nspkg.pth by the version, which a reinstall changes (matplotlib's mpl_toolkits:
        # `matplotlib-3.6.2-nspkg.pth` became `matplotlib-3.7.0.dev0+g0cbcf81-nspkg.pth`, the same line).
        had = set()
        for old_imports, _ in self.pth.values():
            had |= old_imports
        for path, (imports, paths) in sorted(pth_lines(self.sites).items()):
            old_paths = self.pth.get(path, (set(), set()))[1]
            added = sorted(imports - had)
            if imports:  # old setuptools' easy-install.pth moves its paths to the front of sys.path: only eggs
                added += sorted(p for p in paths - old_paths if dist_name(os.path.basename(p)) not in self.names)
            out += ["the install added to " + path + ": " + line[:200] for line in added]
        for plugin in sorted(plugins(self.sites, self.workdir) ^ self.plugins):
            out.append("the install changed the pytest plugins: " + plugin)
        return out


def main():
    nonce = sys.stdin.readline().strip()
    stock = Stock(*sys.argv[1:3])
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:  # the go is the nonce: a line the install writes into this pipe is not
        if line.strip() == nonce:
            sys.stdout.write(nonce + " " + json.dumps(stock.changes()[:50]) + "\n")
            sys.stdout.flush()
            return


if __name__ == "__main__":
    main()
