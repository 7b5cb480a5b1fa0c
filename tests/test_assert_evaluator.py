"""What crosses between an assert case and the solution: plain values keep Python's semantics,
the solution's own objects stay in its process, and what would hand it the verdict is refused."""

from __future__ import annotations

import pytest

from image_builder.graders import AssertTask, CaseStatus, GradeOptions, grade
from image_builder.graders.assert_sides import Codec, ProtocolError
from tests.support.host_executor import HostExecutor


@pytest.fixture(scope="module")
def host():
    return HostExecutor()


@pytest.fixture(scope="module")
def sandbox(mbpp_store):
    """The real runtime: the MBPP store's environment (instance 512 adds nothing to it)."""
    from image_builder.graders.grading import StoreExecutors
    from image_builder.store.store import Store

    with StoreExecutors(Store.open(mbpp_store)) as executors:
        yield executors.for_instance("512")


def run(host, solution: str, *cases: str, strict: bool = False):
    result = grade(AssertTask("t", cases, "t"), solution, host, GradeOptions(strict=strict, case_timeout=5))
    return [(c.status, c.reason) for c in result.cases]


PASSED = (CaseStatus.PASSED, "")

# Returns of library types compare as in one process (the original harness): a Counter equals its
# dict, a namedtuple its tuple, an OrderedDict a dict; attribute reads of a namedtuple work.
LIBRARY = (
    "import collections, decimal, fractions\n"
    "Point = collections.namedtuple('Point', 'x y')\n"
    "def counts(s): return collections.Counter(s)\n"
    "def ordered(): return collections.OrderedDict([('b', 1), ('a', 2)])\n"
    "def grouped(): d = collections.defaultdict(list); d[1].append(2); return d\n"
    "def point(): return Point(1, 2)\n"
    "def window(): return collections.deque([1, 2, 3], maxlen=3)\n"
    "def money(): return decimal.Decimal('1.10')\n"
    "def third(): return fractions.Fraction(1, 3)\n"
    "def odd(): return [float('nan'), -0.0, 1e308 * 10, 2 ** 200, -(2 ** 70), 3 + 4j, b'\\x00\\xff',"
    " bytearray(b'ab'), frozenset({1}), {(1, 2): {3}}, range(3), '\\udcff', True, None]\n"
)


@pytest.mark.parametrize("where", ["host", "sandbox"])
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_library_values_compare_as_in_one_process(request, where, strict):
    host = request.getfixturevalue(where)
    cases = [
        "assert counts('aab') == {'a': 2, 'b': 1} and type(counts('a')).__name__ == 'Counter'",
        "assert ordered() == {'a': 2, 'b': 1} and list(ordered()) == ['b', 'a']",
        "assert grouped() == {1: [2]} and grouped()[5] == []",
        "assert point() == (1, 2) and point().y == 2",
        "assert list(window()) == [1, 2, 3] and window().maxlen == 3",
        "assert money() == __import__('decimal').Decimal('1.1') and str(money()) == '1.10'",
        "assert third() * 3 == 1",
        "v = odd()\nassert v[0] != v[0] and str(v[1]) == '-0.0' and v[2] == float('inf')\n"
        "assert v[3] == 2 ** 200 and v[4] == -(2 ** 70) and v[5] == 3 + 4j and v[6] == b'\\x00\\xff'\n"
        "assert v[7] == bytearray(b'ab') and v[8] == frozenset({1}) and v[9] == {(1, 2): {3}}\n"
        "assert v[10] == range(3) and v[11] == '\\udcff' and v[12] is True and v[13] is None",
        "assert counts('ab') == {'a': 1, 'b': 2}",  # and a wrong answer still fails
    ]
    assert run(host, LIBRARY, *cases, strict=strict) == [PASSED] * 8 + [(CaseStatus.FAILED, "assertion failed")]


def test_numpy_numbers_compare_as_the_numbers_they_hold(host):
    # A stand-in for numpy (not installed here) with the attributes the codec reads.
    fake = ("import sys, types\n"
            "numpy = types.ModuleType('numpy')\n"
            "class generic:\n"
            "    __module__ = 'numpy'\n"
            "    dtype = types.SimpleNamespace(kind='i')\n"
            "    def __init__(self, v): self.v = v\n"
            "    def item(self): return self.v\n"
            "numpy.generic = generic\n"
            "sys.modules['numpy'] = numpy\n"
            "def total(xs): return generic(sum(xs))\n")
    assert run(host, fake, "assert total([1, 2]) == 3 and type(total([1])) is int") == [PASSED]


def test_the_solutions_objects_stay_in_its_process_and_work(host):
    solution = ("class Pair:\n"
                "    def __init__(self, a, b): self.a, self.b = a, b\n"
                "def longest_chain(pairs, n):\n"
                "    pairs = sorted(pairs, key=lambda p: p.b)\n"
                "    end, count = float('-inf'), 0\n"
                "    for p in pairs:\n"
                "        if p.a > end: end, count = p.b, count + 1\n"
                "    return count\n"
                "class Stack:\n"
                "    def __init__(self): self.items = []\n"
                "    def push(self, x): self.items.append(x)\n"
                "    def pop(self): return self.items.pop()\n"
                "def squares(n):\n"
                "    for i in range(n): yield i * i\n"
                "def sort_in_place(xs, table):\n"
                "    xs.sort(); table['sorted'] = True\n"
                "def apply(fn, x): return fn(x)\n"
                "def check(x):\n"
                "    if x < 0: raise ValueError('negative')\n"
                "    return x\n")
    cases = [
        "assert longest_chain([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3",
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and s.items == [1]",
        "assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5",
        "xs, table = [3, 1, 2], {}\nsort_in_place(xs, table)\nassert xs == [1, 2, 3] and table == {'sorted': True}",
        "assert apply(lambda v: v * 2, 21) == 42",
        "try:\n    check(-1)\nexcept ValueError as e:\n    assert str(e) == 'negative'\nelse:\n    assert False",
    ]
    assert run(host, solution, *cases) == [PASSED] * 6


TREES = ("class Node:\n"
         "    def __init__(self, data): self.data, self.left, self.right = data, None, None\n"
         "def depth(n): return 0 if n is None else 1 + max(depth(n.left), depth(n.right))\n"
         "def get(obj, name): return getattr(obj, name, 'unset')\n"
         "def call_hook(obj, x): return obj.hook(x)\n"
         "class Box:\n"
         "    def __init__(self): self.items = {}\n"
         "    def __setitem__(self, k, v): self.items[k] = v\n"
         "    def __getitem__(self, k): return self.items[k]\n"
         "    def __delitem__(self, k): del self.items[k]\n"
         "    def __len__(self): return len(self.items)\n"
         "class Slotted:\n"
         "    __slots__ = ('a',)\n"
         "class Guarded:\n"
         "    def __setattr__(self, name, value): raise ValueError('read-only ' + name)\n")


@pytest.mark.parametrize("where", ["host", "sandbox"])
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_writes_to_the_solutions_objects_reach_them(request, where, strict):
    """MBPP 367's setup builds trees with `root.left = Node(2)`: attribute (and item) writes on a handle are
    done to the solution's object, with plain values, the solution's own objects, or the case's callables."""
    host = request.getfixturevalue(where)
    cases = [
        "n = Node(1)\nn.left = Node(2)\nn.left.left = Node(3)\nn.right = Node(4)\n"
        "assert depth(n) == 3 and n.left.data == 2 and depth(n.left.left) == 1",
        "n = Node(1)\nn.extra = {'a': (1, 2)}\nassert get(n, 'extra') == {'a': (1, 2)} and n.extra == {'a': (1, 2)}",
        "n = Node(1)\nn.hook = lambda v: v * 2\nassert call_hook(n, 21) == 42",  # the case's function, called back
        "n = Node(1)\nn.x = 5\ndel n.x\nassert get(n, 'x') == 'unset'",
        "b = Box()\nb['k'] = [3]\nassert b['k'] == [3] and len(b) == 1\ndel b['k']\nassert len(b) == 0",
        "s = Slotted()\ntry:\n    s.other = 1\nexcept AttributeError:\n    pass\nelse:\n    assert False",
        "g = Guarded()\ng.x = 1",  # the solution's __setattr__ raises: the case does, as in one process
        "n = Node(1)\nn.__class__ = Box",  # `__` names are neither read nor written
        "n = Node(1)\nn.left = Node(2)\nassert depth(n) == 3",  # and a wrong expectation still fails
    ]
    assert run(host, TREES, *cases, strict=strict) == [PASSED] * 6 + [
        (CaseStatus.ERROR, "raised ValueError"), (CaseStatus.ERROR, "raised AttributeError"),
        (CaseStatus.FAILED, "assertion failed")]


# A solution whose function under test is named like a builtin (MBPP 126's `sum`), with a helper `double`.
SUM = ("import builtins\n"
       "def sum(a, b):\n"
       "    return builtins.sum(i for i in range(1, min(a, b)) if a % i == 0 and b % i == 0)\n"
       "def double(x): return 2 * x\n")


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_builtin_name_is_the_solutions_only_as_the_function_under_test(host, strict):
    """The module docstring's rule: the solution's `sum` where it is the only name of the solution the case
    uses and every call of it takes literals; the real `sum` wherever it could see a computed value."""
    cases = [
        "assert sum(10, 15) == 6 and sum(100, 150) == 93",  # the solution's, as in one process
        "assert sum((1, 2)) == 3",  # the solution's still (literal data): its TypeError, as in one process
        "xs = [1, 2]\nassert sum(xs) == 3",  # a variable: the builtin
        "assert sum([len('ab'), 1]) == 3",  # a computed argument: the builtin
        "assert list(map(sum, [[1, 2]])) == [3]",  # not called here: the builtin
        "assert sum([double(1), 1]) == 3",  # another function of the solution is under test: the builtin
        "assert sum(10, 15) == 6 and double(3) == 6",  # so here too (one process would call the solution's)
    ]
    assert run(host, SUM, *cases, strict=strict) == [PASSED, (CaseStatus.ERROR, "raised TypeError")] + \
        [PASSED] * 4 + [(CaseStatus.ERROR, "raised TypeError")]


def test_what_would_hand_the_solution_the_verdict_is_refused(host):
    solution = ("class math:\n"  # a fake module: the case would pass it the expected value
                "    isclose = staticmethod(lambda *a, **k: True)\n"
                "def abs(x): return 0\n"  # a builtin the case uses: the real one is used
                "class Box:\n"
                "    def __contains__(self, x): return True\n"
                "    def __eq__(self, other): return True\n"
                "    __hash__ = object.__hash__\n"
                "def area(r): return 1.0\n"
                "def box(): return Box()\n")
    got = run(host, solution,
              "assert math.isclose(area(1), 3.14159, rel_tol=1e-3)",
              "assert abs(area(1) - 3.14159) < 1e-3",
              "assert 5 in box()",
              "assert [box()] == [1]",
              "import math\nassert math.isclose(area(1), 1.0)")  # the case's own import: the real module
    assert got == [
        (CaseStatus.FAILED, "the case uses 'math' as a module, and the solution binds it to a type instead"),
        (CaseStatus.FAILED, "assertion failed"),
        (CaseStatus.FAILED, "the case asked for membership in the solution's Box object, which is not plain data"),
        (CaseStatus.FAILED, "the case compared with a plain value the solution's Box object, which is not plain data"),
        PASSED,
    ]


def test_strict_mode_takes_no_truth_from_the_solutions_code(host):
    solution = ("class Flag:\n"
                "    def __bool__(self): return True\n"
                "    def __eq__(self, other): return True\n"
                "    __hash__ = object.__hash__\n"
                "def flag(): return Flag()\n")
    cases = ("assert flag()", "assert flag() == flag()")
    assert run(host, solution, *cases) == [PASSED, PASSED]  # as in one process
    assert run(host, solution, *cases, strict=True) == [
        (CaseStatus.FAILED, "strict mode: the case tested the truth of an object of the solution"),
        (CaseStatus.FAILED, "strict mode: the case compared an object of the solution")]


def test_a_solution_that_breaks_the_channel_or_dies_is_an_error(host):
    garbage = "import os\ndef f():\n    os.write(1, b'\\x00\\x00\\x00\\x05xjunk')\n    os.write(3, b'\\xff' * 8)\n"
    assert run(host, garbage, "assert f() == 1")[0][0] is CaseStatus.ERROR
    died = run(host, "import os\ndef f():\n    os._exit(3)\n", "assert f() == 1")
    assert died == [(CaseStatus.ERROR, "ended without a report (exit code 3): the process left before the case "
                                       "finished")]


@pytest.mark.parametrize("data", [b"", b"Z", b"l\xff\xff\xff\xff", b"i\x00\x00\x00\x09\x01", b"u\x00\x00\x00\x01\xff",
                                  b"x\x00\x00\x00\x01l\x00\x00\x00\x00N", b"NN", b"h\x00", b"l" * 100000])
def test_malformed_data_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        Codec.plain.dec(data)


def test_a_solution_flooding_the_channel_is_held_back_not_buffered(host):
    """Well-formed frames as fast as a thread can write them while the evaluator is busy: the grader stops
    reading the solution once a message's worth waits for the evaluator, so its memory stays flat."""
    import threading

    def rss_mb() -> float:
        status = open("/proc/self/status").read()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    flood = ("import os\n"  # each frame a well-formed request the evaluator answers, 16 MiB of bytes
             "n = 16 << 20\n"
             "body = (b'e' + b't' + (2).to_bytes(4, 'big') + b'u' + (5).to_bytes(4, 'big') + b'flood'\n"
             "        + b'b' + n.to_bytes(4, 'big') + b'x' * n)\n"
             "frame = len(body).to_bytes(4, 'big') + body\n"
             "channel = next(fd for fd in range(3, 64) if os.path.exists('/proc/self/fd/%d' % fd)\n"
             "               and os.readlink('/proc/self/fd/%d' % fd).startswith('pipe:'))\n"
             "def pour():\n"
             "    __import__('time').sleep(0.5)  # after the names are answered: the thread writes alone\n"
             "    while True:\n"
             "        os.write(channel, frame)\n"
             "import threading\n"
             "threading.Thread(target=pour, daemon=True).start()\n"
             "def f():\n"
             "    return 1\n")
    before, peak, done = rss_mb(), [0.0], threading.Event()

    def watch() -> None:  # the grader's own memory while the case runs (ru_maxrss is the whole run's peak)
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_mb())

    watcher = threading.Thread(target=watch)
    watcher.start()
    # The case keeps the evaluator busy (not reading) while the solution's thread pours.
    case = "import time\ntime.sleep(2)\nassert f() == 1"
    try:
        got = grade(AssertTask("t", (case,), "t"), flood, host, GradeOptions(case_timeout=4))
    finally:
        done.set()
        watcher.join()
    grown_mb = peak[0] - before
    assert got.cases[0].status is not None  # a verdict, whichever: the flood must not cost the grader memory
    assert grown_mb < 400, f"the grader grew by {grown_mb:.0f} MB"
