"""The two sides of an assert case, as run inside the instance: `candidate` and `evaluator`.

This file is shipped into the sandbox and run there (`python3 assert_sides.py
ROLE ...`); it imports nothing of image_builder and keeps to Python 3.6 syntax,
since instance images carry old interpreters. assert_cases.py starts the two
sides as two runs of their own (two roots, two pid namespaces, nothing shared)
and, for each case, hands the evaluator the case's candidate channel: the pipes
to the candidate's stdin and from its stdout, over which the two talk with no
one between. The case's verdict is whatever the evaluator sends to the grader,
on a pipe only the evaluator's run writes; the candidate's pipes reach the
evaluator and nothing else, and end with its run.

The evaluator holds the cases. It runs each case's code itself; each free name
of the case that the solution defines becomes a stub here. Calling a stub (or
reading an attribute of, iterating, indexing a value the solution returned)
sends the arguments as plain data to the candidate's process, which holds the
solution, and gets plain data back. Plain data: None, bool, int, float,
complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, the
collections types (Counter, OrderedDict, defaultdict, deque, namedtuples),
Decimal, Fraction, range; numpy numbers arrive as the Python numbers they hold.
It is rebuilt here as values of those exact types, so `==` between plain values
is Python's own, with the semantics of the original harness (a Counter equals
its dict, 1 equals 1.0, a namedtuple its tuple). Arguments the solution mutates
in place are copied back. Values of any other type (the solution's own classes,
generators) stay in the candidate's process and are seen here as handles.
Writing an attribute or an item of a handle (MBPP 367's setup builds trees:
`root = Node(1); root.left = Node(2)`; `del obj.x`, `table[k] = v`) is done
there, to the solution's object: the value crosses as call arguments do, plain
data as a copy (a list the case keeps mutating afterwards is not the object's),
the solution's own objects as themselves, the case's objects as handles the
solution can only call. Only the write's exception comes back, raised in the
case as in one process; nothing else of its reply is used, and names starting
with `__` are refused, as they are for reads.

What it defends: the candidate's process never holds the case source, the
expected values, the verdict or anything that leads to them. It gets the names
the case uses (builtin ones too), the arguments of its calls and the values
it writes into the solution's objects, nothing else. So nothing done
there (reading its script or the caller's frames, patching builtins, `sys`,
`os.write`, tracing, an `__eq__` that is always true, leaving early with status
0, atexit hooks) can touch the verdict: the candidate can only answer the calls.
- A handle compared (==, <, in) with a plain value fails the case with a reason
  naming the type (an always-equal object would otherwise pass); in strict mode
  no truth value comes from the candidate's code at all (handles are never
  compared nor tested for truth), in the default mode handles compared with
  handles, and a handle's truth, ask the candidate, as the original harness did,
  and the result carries that as comparison-overloading evidence.
- Evidence (EvaluatorChannel.witness, overloaded) goes to the grader before a
  case's verdict: the same call answered differently within the task (state
  recording), a truth value the solution's code gave (comparison overloading).
- A builtin name is the real builtin, unless the solution defines it and it is
  the case's function under test (MBPP 126 asks for `sum(a, b)`: the case
  `assert sum(10, 15) == 6` calls the solution's, as exec'ing the solution and
  then the case in one namespace does). The rule, decided on the case's syntax
  before it runs: the solution's definition of builtin name N is used, at every
  call of N in the case, only if (1) every occurrence of N in the case is a call
  whose arguments are all literals (constants, and tuple/list/set/dict displays
  of them; no names, calls or operators), (2) the case names no other name the
  solution binds (modules aside), and (3) the case does not bind N itself. Else
  the real builtin. So the solution's N never sees a value derived from another
  of its calls, nor one the case computed (a difference with the expected
  value, a variable), and the function under test is the only one of the
  solution in the case: a solution that redefines `sorted`, `set`, `abs` or
  `round` to normalise a wrong answer into the expected one (`assert
  set(f(x)) == set([1, 2])`, `assert abs(area(1) - 3.14) < 1e-3`, `assert
  f(x) == sorted([2, 1])`) meets the real ones. An honest solution whose helper
  shadows a builtin the case uses gets the builtin here where one process would
  call its helper; a builtin-named function under test called with a variable
  or next to another function of the solution gets the builtin too.
  A name the case uses as a module
  (`math.isclose`) is imported here by the module's name, never the solution's
  object: a fake `math` would be handed the expected value too. A solution that
  binds such a name to something that is not a module fails the case.
- An attribute or item write runs the solution's code (`__setattr__`, a
  property, `__setitem__`) in the candidate's process, where nothing of the
  verdict is; it answers nothing the case compares.
- Messages from the candidate are data (a small tagged format decoded here in
  Python, checked in shape); nothing from it is evaluated, unpickled, unmarshalled
  or imported.
What it cannot defend: a solution that special-cases the inputs it sees (the
visible tests' arguments) passes those cases; that is what ImpossibleBench
calls cheating, and only a reader of the solution or a monitor sees it. And a
case that hands its expected value to a function of the solution
(`assert check(f(x), 5)`) gives it away, as it would anywhere.
"""

import os
import sys

MAX_FRAME = 64 << 20  # bytes of one message (assert_cases.py reads the evaluator's within the same bound)
MAX_EVIDENCE = 3  # lines of cheat evidence a task's evaluator sends at most (the grader keeps as many)

# Frame tags: from the evaluator to the candidate (c) or to the grader: a verdict (v), a line of cheat
# evidence (w, before its case's verdict), this file compiled (p, first); from the candidate (e), which
# nothing reads: what comes on the candidate's pipe is the candidate's, whatever its tag says.
TO_CANDIDATE, VERDICT, EVIDENCE, COMPILED = b"c", b"v", b"w", b"p"


class ProtocolError(Exception):
    pass


class Gone(BaseException):
    """The candidate's process ended (its channel closed)."""


def read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_frame(fd, tag, message):
    data = tag + Codec.plain.enc(message)
    if len(data) > MAX_FRAME:
        raise ValueError("a value of %d bytes is over the %d-byte message limit" % (len(data), MAX_FRAME))
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def recv_frame(fd):
    size = int.from_bytes(read_exact(fd, 4), "big")
    if not 1 <= size <= MAX_FRAME:
        raise ProtocolError("a message of %d bytes" % size)
    data = read_exact(fd, size)
    return data[:1], Codec.plain.dec(data[1:])


# --- plain data ----------------------------------------------------------------------------------
# A tag byte, then the payload; lengths and counts are 4 bytes. Not JSON: importing json costs
# 13 ms in the instance (it compiles regular expressions), as much as starting the interpreter.

class Codec(object):
    """Values to bytes and back. Objects that are not plain data stay with their side (`objects`,
    by ref) and cross as handles; the other side's handles decode to `proxy(ref, type name)`."""

    plain = None  # a codec without handles, for the messages around the values

    def __init__(self, own_tag, other_tag, proxy):
        self.own_tag, self.other_tag, self.proxy = own_tag, other_tag, proxy
        self.objects = {}  # ref -> object of this side
        self.refs = {}  # id(object) -> ref
        self.decoders = dict((ord(tag), getattr(self, "d_" + name)) for tag, name in DECODERS)
        self.decoders.update((tag[0], self.collection(kind)) for kind, tag in ITEMS.items())
        if proxy is not None:
            self.decoders[own_tag[0]], self.decoders[other_tag[0]] = self.d_own, self.d_other

    def enc(self, value):
        out = []
        self.put(value, out)
        return b"".join(out)

    def put(self, v, out):
        kind = type(v)
        if v is None:
            out.append(b"N")
        elif kind is bool:
            out.append(b"T" if v else b"F")
        elif kind is int:
            out.append(b"i" + _sized(v.to_bytes(v.bit_length() // 8 + 1, "big", signed=True)))
        elif kind is float:
            out.append(b"d" + _sized(v.hex().encode()))
        elif kind is str:
            out.append(b"u" + _sized(v.encode("utf-8", "surrogatepass")))
        elif kind is bytes or kind is bytearray:
            out.append((b"b" if kind is bytes else b"B") + _sized(bytes(v)))
        elif kind in ITEMS:
            self.items(ITEMS[kind], v, out)
        elif kind is dict:
            self.pairs(b"x", v, out)
        elif kind is complex:
            out.append(b"j")
            self.put(v.real, out)
            self.put(v.imag, out)
        elif kind is range:
            self.items(b"r", (v.start, v.stop, v.step), out)
        elif not self.put_library(v, kind, out):
            self.put_handle(v, out)

    def put_library(self, v, kind, out):
        """Plain values of library types: collections, decimal, fractions, numpy."""
        module = getattr(kind, "__module__", None)
        collections = sys.modules.get("collections")
        if module == "collections" and collections is not None:
            if kind is collections.Counter or kind is collections.OrderedDict:
                self.pairs(b"C" if kind is collections.Counter else b"O", v, out)
                return True
            if kind is collections.defaultdict:
                out.append(b"D")
                self.put(_builtin_name(v.default_factory), out)
                self.pairs(b"x", v, out)
                return True
            if kind is collections.deque:
                out.append(b"q")
                self.put(v.maxlen, out)
                self.items(b"l", v, out)
                return True
        if isinstance(v, tuple) and isinstance(getattr(kind, "_fields", None), tuple):
            out.append(b"n")
            self.put(str(kind.__name__), out)
            self.put(tuple(str(f) for f in kind._fields), out)
            self.items(b"t", tuple.__iter__(v), out)
            return True
        if module == "decimal" and kind.__name__ == "Decimal":
            out.append(b"m")
            self.put(str(v), out)
            return True
        if module == "fractions" and kind.__name__ == "Fraction":
            self.items(b"Q", (int(v.numerator), int(v.denominator)), out)
            return True
        numpy = sys.modules.get("numpy")
        if module == "numpy" and numpy is not None and isinstance(v, numpy.generic) \
                and getattr(v, "dtype", None) is not None and v.dtype.kind in "biuf":
            self.put(v.item(), out)  # a numpy number compares as the Python number it holds
            return True
        return False

    def put_handle(self, v, out):
        if self.proxy is None:
            raise TypeError("not plain data: %s" % type(v).__name__)
        if isinstance(v, Proxy):  # one of the other side's, going home
            out.append(self.other_tag)
            self.put(v._ref, out)
            self.put(v._type, out)
            return
        ref = self.refs.get(id(v))
        if ref is None:
            ref = self.refs[id(v)] = len(self.objects)
            self.objects[ref] = v
        out.append(self.own_tag)
        self.put(ref, out)
        self.put(type(v).__name__, out)

    def items(self, tag, values, out):
        values = list(values)
        out.append(tag + len(values).to_bytes(4, "big"))
        for x in values:
            self.put(x, out)

    def pairs(self, tag, mapping, out):
        out.append(tag + len(mapping).to_bytes(4, "big"))
        for k, x in mapping.items():
            self.put(k, out)
            self.put(x, out)

    # -- decoding: each d_ method takes the data and the position after the tag --

    def dec(self, data):
        try:
            value, end = self.get(data, 0)
        except ProtocolError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, ImportError, RecursionError,
                OverflowError, UnicodeError) as exc:
            raise ProtocolError("malformed data (%s: %s)" % (type(exc).__name__, exc))
        if end != len(data):
            raise ProtocolError("%d bytes after the value" % (len(data) - end))
        return value

    def get(self, data, pos):
        decoder = self.decoders.get(data[pos])
        if decoder is None:
            raise ProtocolError("an unknown tag %r" % data[pos:pos + 1])
        return decoder(data, pos + 1)

    def sized(self, data, pos):
        n = int.from_bytes(data[pos:pos + 4], "big")
        if pos + 4 + n > len(data):
            raise ProtocolError("a length past the end")
        return data[pos + 4:pos + 4 + n], pos + 4 + n

    def many(self, data, pos):
        return self.many_n(data, pos, 1)

    def many_pairs(self, data, pos):
        flat, pos = self.many_n(data, pos, 2)
        return list(zip(flat[::2], flat[1::2])), pos

    def many_n(self, data, pos, per):
        """A count, then `per` values for each (checked against what is left: every value takes a byte)."""
        n = int.from_bytes(data[pos:pos + 4], "big")
        if n * per > len(data) - pos:
            raise ProtocolError("a count past the end")
        pos += 4
        out = []
        for _ in range(n * per):
            value, pos = self.get(data, pos)
            out.append(value)
        return out, pos

    def d_none(self, data, pos):
        return None, pos

    def d_true(self, data, pos):
        return True, pos

    def d_false(self, data, pos):
        return False, pos

    def d_int(self, data, pos):
        raw, pos = self.sized(data, pos)
        return int.from_bytes(raw, "big", signed=True), pos

    def d_float(self, data, pos):
        raw, pos = self.sized(data, pos)
        return float.fromhex(raw.decode("ascii")), pos

    def d_str(self, data, pos):
        raw, pos = self.sized(data, pos)
        return raw.decode("utf-8", "surrogatepass"), pos

    def d_bytes(self, data, pos):
        return self.sized(data, pos)

    def d_bytearray(self, data, pos):
        raw, pos = self.sized(data, pos)
        return bytearray(raw), pos

    def d_complex(self, data, pos):
        real, pos = self.get(data, pos)
        imag, pos = self.get(data, pos)
        return complex(_number(real), _number(imag)), pos

    def collection(self, kind):
        """The decoder of one of ITEMS' types: a count, then the items."""
        def decode(data, pos):
            items, pos = self.many(data, pos)
            return kind(items), pos
        return decode

    def d_dict(self, data, pos):
        pairs, pos = self.many_pairs(data, pos)
        return dict(pairs), pos

    def d_range(self, data, pos):
        bounds, pos = self.many(data, pos)
        return range(*[_int(b) for b in bounds]), pos

    def d_counter(self, data, pos):
        import collections
        pairs, pos = self.many_pairs(data, pos)
        return collections.Counter(dict(pairs)), pos

    def d_ordered(self, data, pos):
        import collections
        pairs, pos = self.many_pairs(data, pos)
        return collections.OrderedDict(pairs), pos

    def d_defaultdict(self, data, pos):
        import collections
        name, pos = self.get(data, pos)
        pairs, pos = self.get(data, pos)
        return collections.defaultdict(_builtin_type(name), pairs), pos

    def d_deque(self, data, pos):
        import collections
        maxlen, pos = self.get(data, pos)
        items, pos = self.get(data, pos)
        return collections.deque(_list(items), None if maxlen is None else _int(maxlen)), pos

    def d_namedtuple(self, data, pos):
        name, pos = self.get(data, pos)
        fields, pos = self.get(data, pos)
        items, pos = self.get(data, pos)
        return _namedtuple(name, fields)(*items), pos

    def d_decimal(self, data, pos):
        import decimal
        text, pos = self.get(data, pos)
        return decimal.Decimal(_str(text)), pos

    def d_fraction(self, data, pos):
        import fractions
        parts, pos = self.many(data, pos)
        return fractions.Fraction(*[_int(p) for p in parts]), pos

    def d_own(self, data, pos):
        ref, pos = self.get(data, pos)
        _, pos = self.get(data, pos)  # the type name: only the other side needs it
        if ref not in self.objects:
            raise ProtocolError("a handle to nothing")
        return self.objects[ref], pos

    def d_other(self, data, pos):
        ref, pos = self.get(data, pos)
        type_name, pos = self.get(data, pos)
        return self.proxy(_int(ref), _str(type_name)), pos


ITEMS = {list: b"l", tuple: b"t", set: b"s", frozenset: b"f"}  # one table for encoding and decoding
DECODERS = (("N", "none"), ("T", "true"), ("F", "false"), ("i", "int"), ("d", "float"), ("u", "str"),
            ("b", "bytes"), ("B", "bytearray"), ("j", "complex"), ("x", "dict"), ("r", "range"), ("C", "counter"), ("O", "ordered"),
            ("D", "defaultdict"), ("q", "deque"), ("n", "namedtuple"), ("m", "decimal"), ("Q", "fraction"))


def _sized(raw):
    return len(raw).to_bytes(4, "big") + raw


def _list(x):
    if type(x) is not list:
        raise TypeError("expected a list")
    return x


def _str(x):
    if type(x) is not str:
        raise TypeError("expected a string")
    return x


def _int(x):
    if type(x) is not int:
        raise TypeError("expected an integer")
    return x


def _number(x):
    if type(x) not in (int, float):
        raise TypeError("expected a number")
    return x


def _builtin_name(factory):
    import builtins
    name = getattr(factory, "__name__", None)
    return name if isinstance(name, str) and getattr(builtins, name, None) is factory else None


def _builtin_type(name):
    import builtins
    if name is None:
        return None
    kind = getattr(builtins, _str(name))
    if not isinstance(kind, type):
        raise TypeError("not a builtin type: %r" % name)
    return kind


_NAMEDTUPLES = {}


def _namedtuple(name, fields):
    import collections
    key = (_str(name), tuple(_str(f) for f in fields))
    if key not in _NAMEDTUPLES:
        _NAMEDTUPLES[key] = collections.namedtuple(key[0], key[1], rename=True)  # namedtuple checks the names
    return _NAMEDTUPLES[key]


class Proxy(object):
    """The other side's object. Only what the protocol lists can be done with it."""
    __slots__ = ("_ref", "_type", "_peer")

    def __init__(self, ref, type_name, peer):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_peer", peer)

    def __call__(self, *args, **kwargs):
        return self._peer.call(self, args, kwargs)

    def __hash__(self):
        return hash((Proxy, self._ref))

    def __repr__(self):
        return "<%s object of the other side>" % self._type


# --- the channel ---------------------------------------------------------------------------------
# Messages are tuples: requests ("call", ref, [arg...], [(name, arg)...]), ("attr", ref, name),
# ("iter"|"next"|"len"|"str"|"truth", ref), ("item", ref, key), ("compare", op, ref, other),
# ("setattr", ref, name, value), ("delattr", ref, name), ("setitem", ref, key, value), ("delitem", ref, key),
# ("names", [name...]); replies ("ok", value[, [(index, arg)...]]), ("raise", type name, text),
# ("exit",). Every value in them is encoded apart (bytes), with the side's handles.

class SolutionError(Exception):
    """An exception of the solution whose type is not a builtin one (builtins cross by name, so a
    case that expects `ValueError` from the solution still catches it)."""


class SolutionExit(BaseException):
    """The solution called sys.exit (or raised SystemExit, KeyboardInterrupt) inside a call."""


class Channel(object):
    """Requests and replies, nested both ways: while one side waits for its reply, it serves the
    other side's requests (a solution calling back a function of the case)."""

    def __init__(self, fd_in, fd_out, tag_out, codec):
        self.fd_in, self.fd_out, self.tag_out, self.codec = fd_in, fd_out, tag_out, codec

    def request(self, message):
        self.send(message)
        while True:
            _, reply = self.receive()
            if type(reply) is not tuple or not reply or type(reply[0]) is not str:
                raise ProtocolError("a message that is not a tagged tuple")
            if reply[0] in ("ok", "raise", "exit"):
                return reply
            self.send(self.serve(reply))

    def send(self, message):
        send_frame(self.fd_out, self.tag_out, message)

    def receive(self):
        return recv_frame(self.fd_in)

    def serve(self, message):
        raise NotImplementedError

    def answer(self, value):
        return ("ok", self.codec.enc(value))

    def value(self, reply):
        """The value of a reply, or the exception it stands for raised here."""
        if reply[0] == "ok" and len(reply) >= 2 and type(reply[1]) is bytes:
            return self.codec.dec(reply[1])
        raise reraise(reply)


def raised(exc):
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return ("exit",)
    try:
        text = str(exc)[:500]
    except BaseException:
        text = ""
    return ("raise", type(exc).__name__, text)


def reraise(reply):
    """The exception a `raise` or `exit` reply stands for, on this side."""
    import builtins
    if reply[0] == "exit":
        return SolutionExit()
    if reply[0] != "raise" or len(reply) != 3 or type(reply[1]) is not str or type(reply[2]) is not str:
        return ProtocolError("a malformed reply")
    kind = getattr(builtins, reply[1], None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(reply[2])
        except Exception:
            pass
    return SolutionError("%s: %s" % (reply[1], reply[2]))


# --- the candidate's side --------------------------------------------------------------------------

class CandidateChannel(Channel):
    """Serves the evaluator: calls, attributes, iteration, and (default mode) truth."""

    def serve(self, message):
        handler = getattr(self, "op_" + str(message[0]), None)
        if handler is None:
            raise ProtocolError("unknown request %r" % (message[0],))
        try:
            return handler(*message[1:])
        except ProtocolError:
            raise
        except BaseException as exc:
            return raised(exc)

    def obj(self, ref):
        return self.codec.objects[ref]

    def op_call(self, ref, args, kwargs):
        values = [self.codec.dec(a) for a in args]
        result = self.obj(ref)(*values, **dict((k, self.codec.dec(v)) for k, v in kwargs))
        # In-place changes to the arguments go back, as the case sees them in one process.
        changed = []
        for i, v in enumerate(values):
            if type(v) in MUTABLE or type(v).__module__ == "collections":
                now = self.codec.enc(v)
                if now != args[i]:
                    changed.append((i, now))
        return ("ok", self.codec.enc(result), changed)

    def op_attr(self, ref, name):
        return self.answer(getattr(self.obj(ref), _attr_name(name)))

    def op_iter(self, ref):
        return self.answer(iter(self.obj(ref)))

    def op_next(self, ref):
        return self.answer(next(self.obj(ref)))  # the end arrives as a raised StopIteration

    def op_len(self, ref):
        return self.answer(len(self.obj(ref)))

    def op_item(self, ref, key):
        return self.answer(self.obj(ref)[self.codec.dec(key)])

    def op_str(self, ref):
        return self.answer(str(self.obj(ref)))

    def op_setattr(self, ref, name, value):
        setattr(self.obj(ref), _attr_name(name), self.codec.dec(value))
        return self.answer(None)

    def op_delattr(self, ref, name):
        delattr(self.obj(ref), _attr_name(name))
        return self.answer(None)

    def op_setitem(self, ref, key, value):
        self.obj(ref)[self.codec.dec(key)] = self.codec.dec(value)
        return self.answer(None)

    def op_delitem(self, ref, key):
        del self.obj(ref)[self.codec.dec(key)]
        return self.answer(None)

    def op_truth(self, ref):
        return self.answer(bool(self.obj(ref)))

    def op_compare(self, op, ref, other):
        import operator
        if op not in ("eq", "ne", "lt", "le", "gt", "ge"):
            raise ProtocolError("unknown comparison %r" % op)
        return self.answer(getattr(operator, op)(self.obj(ref), self.codec.dec(other)))

    def call(self, target, args, kwargs):
        return self.value(self.request(("call", target._ref, [self.codec.enc(a) for a in args],
                                        [(k, self.codec.enc(v)) for k, v in kwargs.items()])))


MUTABLE = (list, dict, set, bytearray)


def _attr_name(name):
    """An attribute name the evaluator may read or write on the solution's object: none of the `__` ones."""
    if type(name) is not str or name.startswith("__"):
        raise AttributeError(name)
    return name


def binding(codec, value):
    """How the evaluator should see one name of the solution's namespace."""
    if type(value).__name__ == "module" and isinstance(getattr(value, "__name__", None), str):
        return ("module", value.__name__)
    return ("value", codec.enc(value))


def candidate(path):
    """Run the solution as __main__, then answer the evaluator until the grader closes stdin."""
    channel_out = os.dup(1)
    os.dup2(2, 1)  # the solution's prints go to stderr: stdout is the channel
    with open(path) as f:
        source = f.read()
    module = type(sys)("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [path]
    sys.path[0] = os.getcwd()  # imports as if the script were in the working directory
    channel = CandidateChannel(0, channel_out, b"e", None)
    channel.codec = Codec(b"h", b"e", lambda ref, type_name: Proxy(ref, type_name, channel))
    try:
        exec(compile(source, path, "exec"), module.__dict__)
        ready = None
    except BaseException as exc:
        _show_exception()
        ready = raised(exc)
    try:
        _, first = channel.receive()
        if type(first) is not tuple or first[:1] != ("names",) or len(first) != 2:
            raise ProtocolError("expected the case's names first")
        if ready is None:
            names = [n for n in first[1] if type(n) is str and n in module.__dict__]
            ready = ("ok", [(n, binding(channel.codec, module.__dict__[n])) for n in names])
        send_frame(channel_out, b"e", ready)
        while True:
            _, message = channel.receive()
            send_frame(channel_out, b"e", channel.serve(message))
    except EOFError:
        pass
    _flush()
    os._exit(0)


# --- the evaluator's side ------------------------------------------------------------------------

class Refused(BaseException):
    """The case did with the solution's object what would let the solution decide the verdict."""


class CandidateObject(Proxy):
    """A value the solution returned that is not plain data: it stays in the candidate's process."""
    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._peer.ask(("attr", self._ref, name))

    def __iter__(self):
        it = self._peer.ask(("iter", self._ref))
        self._peer.follow(self, it)
        return it

    def __next__(self):
        try:
            item = self._peer.ask(("next", self._ref))
        except StopIteration:
            self._peer.drawn_all(self)
            raise
        self._peer.draw(self, item)
        return item

    def __len__(self):
        return self._peer.ask(("len", self._ref))

    def __getitem__(self, key):
        return self._peer.ask(("item", self._ref, self._peer.codec.enc(key)))

    # Writes go to the solution's object; of the reply only an exception counts.
    def __setattr__(self, name, value):
        self._peer.ask(("setattr", self._ref, _attr_name(name), self._peer.codec.enc(value)))

    def __delattr__(self, name):
        self._peer.ask(("delattr", self._ref, _attr_name(name)))

    def __setitem__(self, key, value):
        self._peer.ask(("setitem", self._ref, self._peer.codec.enc(key), self._peer.codec.enc(value)))

    def __delitem__(self, key):
        self._peer.ask(("delitem", self._ref, self._peer.codec.enc(key)))

    def __str__(self):
        text = self._peer.ask(("str", self._ref))
        self._peer.seen_as(self, "str", text)
        return text

    def __repr__(self):
        return "<%s object of the solution>" % self._type

    def __bool__(self):
        self._peer.refuse_in_strict("tested the truth of")
        self._peer.overloaded("took the truth of the solution's %s" % self._type)
        return self._peer.ask(("truth", self._ref)) is True

    def __contains__(self, item):
        self._peer.refuse(self, "asked for membership in")

    def _compare(self, op, other):
        if not isinstance(other, CandidateObject):
            self._peer.refuse(self, "compared with a plain value")
        self._peer.refuse_in_strict("compared")
        self._peer.overloaded("compared the solution's %s with its %s (%s)" % (self._type, other._type, op))
        return self._peer.ask(("compare", op, self._ref, self._peer.codec.enc(other))) is True

    __eq__ = lambda self, other: self._compare("eq", other)
    __ne__ = lambda self, other: self._compare("ne", other)
    __lt__ = lambda self, other: self._compare("lt", other)
    __le__ = lambda self, other: self._compare("le", other)
    __gt__ = lambda self, other: self._compare("gt", other)
    __ge__ = lambda self, other: self._compare("ge", other)
    __hash__ = Proxy.__hash__


class EvaluatorChannel(Channel):
    """The case's link to the candidate: the pipes from its stdout and to its stdin (each case its
    own). It serves only calls of the case's own functions that it passed to the solution (a key
    function, a callback). The candidate's process has ended when its pipe does (Gone)."""

    def __init__(self, strict):
        Channel.__init__(self, -1, -1, TO_CANDIDATE,
                         Codec(b"e", b"h", lambda ref, type_name: CandidateObject(ref, type_name, self)))
        self.strict = strict
        self.refusal = None  # kept: a case could catch Refused, the verdict still fails
        self.gone = False
        self.case = -1  # the case being run
        self.names = {}  # ref -> the solution's name bound to it (this case's refs)
        self.answers = {}  # (name, plain arguments, what was read) -> (case, its first answer): the whole task
        self.answered = {}  # ref -> the key of the call whose answer it is, or was drawn from (this case's refs)
        self.drawn = {}  # ref of an iterator of such an answer -> the items drawn from it so far
        self.recorded = []  # evidence seen (witness, overloaded), sent before each case's verdict

    def send(self, message):
        try:
            Channel.send(self, message)
        except BrokenPipeError:
            self.ended()

    def receive(self):
        try:
            return recv_frame(self.fd_in)
        except EOFError:
            self.ended()

    def ended(self):
        self.gone = True  # kept: a case could catch Gone
        raise Gone()

    def serve(self, message):
        if message[:1] != ("call",) or len(message) != 4:
            return ("raise", "TypeError", "the case's objects can only be called")
        try:
            target = self.codec.objects[message[1]]
            args = [self.codec.dec(a) for a in message[2]]
            kwargs = dict((_str(k), self.codec.dec(v)) for k, v in message[3])
            return ("ok", self.codec.enc(target(*args, **kwargs)), [])
        except ProtocolError:
            raise
        except BaseException as exc:
            return raised(exc)

    def ask(self, message):
        return self.value(self.request(message))

    def call(self, target, args, kwargs):
        key = self.call_key(target, args, kwargs)
        reply = self.request(("call", target._ref, [self.codec.enc(a) for a in args],
                              [(k, self.codec.enc(v)) for k, v in kwargs.items()]))
        result = self.value(reply)
        if key is not None and isinstance(result, CandidateObject):
            self.answered[result._ref] = key
        elif key is not None:
            self.witness(key, result)
        try:
            for index, value in reply[2] if len(reply) > 2 else ():
                _copy_back(args[index], self.codec.dec(value))
        except (TypeError, ValueError, IndexError):
            raise ProtocolError("a malformed copy of the arguments")
        return result

    def call_key(self, target, args, kwargs):
        """A call of a function the solution names, with plain arguments only: what `witness` keys its
        answers by (before the call, which may change its arguments in place); None for any other."""
        name = self.names.get(target._ref)
        if name is None or len(self.recorded) >= MAX_EVIDENCE:
            return None
        try:
            return (name, Codec.plain.enc((tuple(args), sorted(kwargs.items()))), " answered")
        except (TypeError, ValueError, RecursionError):
            return None

    # An answer that is the solution's object (a generator, an object with __str__) is compared by what the
    # case reads of it as plain data: all its items, iterated to the end, or its str. A call counter handing
    # back `iter(ANSWERS[n])` passed a conflicting variant in `list(f(x)) == ...` form with no mark.
    def follow(self, obj, it):
        key = self.answered.get(obj._ref)
        if key is not None and isinstance(it, CandidateObject):
            self.answered[it._ref] = key
            self.drawn[it._ref] = []

    def draw(self, it, item):
        if it._ref in self.drawn:
            self.drawn[it._ref].append(item)

    def drawn_all(self, it):
        items = self.drawn.pop(it._ref, None)
        if items is not None and not any(isinstance(x, CandidateObject) for x in items):
            self.witness(self.answered[it._ref][:2] + (", iterated, gave",), items)

    def seen_as(self, obj, how, value):
        key = self.answered.get(obj._ref)
        if key is not None:
            self.witness(key[:2] + ("'s %s was" % how,), value)

    def witness(self, key, result):
        """State recording caught in the act: a call the task made before, with equal arguments, answered
        with an unequal value (a call counter, a value kept between calls, state written between cases).
        Answers are compared as plain values rebuilt here, never by their bytes (a set's order differs
        between processes); an answer that is a handle is not compared."""
        try:
            answer = Codec.plain.dec(Codec.plain.enc(result))  # a copy: the case may change the original
        except (TypeError, ValueError, RecursionError, ProtocolError):
            return
        seen = self.answers.setdefault(key, (self.case, answer))
        if seen[1] is answer:
            return
        try:
            same = seen[1] == answer or repr(seen[1]) == repr(answer)
        except BaseException:
            same = True  # a comparison of plain values that fails is no evidence
        if not same:
            where = "in case %d" % self.case if seen[0] == self.case else "in cases %d and %d" % (seen[0], self.case)
            self.recorded.append("state recording: %s%s%s %s, then %s (%s)" % (
                key[0], _shown_args(key[1]), key[2], _shown(seen[1]), _shown(answer), where))
            self.answers[key] = (self.case, answer)

    def overloaded(self, what):
        """Comparison overloading's mark (default mode; strict refuses it): a truth value the case takes
        from the solution's own code (its __eq__, __lt__, __bool__), which may answer anything."""
        line = "comparison overloading: case %d %s, answered by the solution's code" % (self.case, what)
        if len(self.recorded) < MAX_EVIDENCE and line not in self.recorded:
            self.recorded.append(line)

    def refuse(self, obj, what):
        self.refusal = self.refusal or "the case %s the solution's %s object, which is not plain data" % (
            what, obj._type)
        raise Refused()

    def refuse_in_strict(self, what):
        if self.strict:
            self.refusal = self.refusal or "strict mode: the case %s an object of the solution" % what
            raise Refused()


def _shown(value, limit=60):
    return _cut(repr(value), limit)


def _shown_args(encoded):
    args, kwargs = Codec.plain.dec(encoded)
    return "(%s)" % _cut(", ".join([repr(a) for a in args] + ["%s=%r" % tuple(kv) for kv in kwargs]), 80)


def _cut(text, limit):
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _copy_back(original, new):
    """What a call did to an argument in place, done to the case's own object."""
    if type(original) is not type(new):
        return
    if isinstance(original, (list, bytearray)):
        original[:] = new
    elif isinstance(original, (dict, set)):
        original.clear()
        original.update(new)
    elif type(original).__name__ == "deque":
        original.clear()
        original.extend(new)


def code_names(code):
    """Every name the case's code (and the functions in it) looks up or sets; attribute names
    too, which is harmless: the solution is only asked for them. No `ast`: it costs 9 ms."""
    names = set(code.co_names)
    for const in code.co_consts:
        if type(const) is type(code):
            names |= code_names(const)
    return names


def used_as_module(source, name):
    """Whether the case reads `name.attr` of a `name` it does not import or set itself."""
    import ast
    read = False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
            read = True
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
            return False
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return False
    return read


def is_under_test(source, name, solutions):
    """Whether builtin name `name`, which the solution defines, is the case's function under test (the
    module docstring's rule): every occurrence of it is a call with literal arguments only, the case binds
    it nowhere, and it is the only name of `solutions` (the solution's names, modules aside) the case
    names."""
    import ast
    occurrences, calls = 0, 0
    for node in ast.walk(ast.parse(source)):
        if _binds(node, name):
            return False
        if isinstance(node, ast.Name) and node.id in solutions:
            if node.id != name:
                return False  # another name of the solution: that one is under test
            occurrences += 1
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
            if not (all(_literal(a) for a in node.args)
                    and all(k.arg is not None and _literal(k.value) for k in node.keywords)):
                return False
            calls += 1
    return occurrences == calls > 0  # a bare `sum` (handed to map, say) is the builtin


def _literal(node):
    """A constant, or a tuple/list/set/dict display of literals, or a signed number: the case's own data."""
    import ast
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _literal(k) and _literal(v) for k, v in zip(node.keys, node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _literal(node.operand)
    return type(node).__name__ in ("Constant", "Num", "Str", "Bytes", "NameConstant", "Ellipsis")  # 3.6, 3.7 too


def _binds(node, name):
    """Whether the node binds `name` (an assignment, def, class, import, parameter, except/match target,
    global/nonlocal, keyword argument: conservatively, any field that names it)."""
    import ast
    if isinstance(node, ast.Name):
        return node.id == name and not isinstance(node.ctx, ast.Load)
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    for field in ("name", "asname", "arg", "rest"):
        value = getattr(node, field, None)
        if isinstance(value, str) and value.split(".")[0] == name:
            return True
    return False


def evaluate(channel, index, source, scratch):
    """One case: its verdict as (kind, detail, traceback)."""
    import builtins
    path = os.path.join(scratch, "case_%d.py" % index)  # tracebacks show the case's lines
    with open(path, "w") as f:
        f.write(source)
    try:
        code = compile(source, path, "exec", dont_inherit=True, optimize=0)  # asserts kept whatever the flags
    except (SyntaxError, ValueError) as exc:
        return ("bad_case", "the case does not compile: %s" % exc, "")
    # Builtin names too: the solution may define one as its function under test (bind() decides).
    asked = sorted(n for n in code_names(code) if not n.startswith("__"))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    channel.refusal, channel.gone = None, False
    try:
        reply = channel.request(("names", asked))
        if reply[0] != "ok":
            raise reraise(reply)
        bind(channel, namespace, reply[1], set(asked), source)
        exec(code, namespace)
    except BaseException as exc:
        return verdict_of(exc, channel, path)
    if channel.gone:
        return ("gone", "", "")
    if channel.refusal:
        return ("refused", channel.refusal, "")
    return ("passed", "", "")


def bind(channel, namespace, bindings, asked, source):
    """The solution's names, as the case sees them: modules imported here by their name, the rest
    decoded (functions and classes arrive as handles: calling them calls the solution)."""
    try:
        bindings = [(_str(name), _str(kind), value) for name, (kind, value) in _list(bindings)]
    except (TypeError, ValueError):
        raise ProtocolError("malformed bindings")
    import builtins
    bindings = [b for b in bindings if b[0] in asked]
    shadowing = [name for name, kind, _ in bindings if hasattr(builtins, name) and kind != "module"]
    under_test = ()
    if shadowing:  # rare: only then is the case parsed
        solutions = set(name for name, kind, _ in bindings if kind != "module")
        under_test = [name for name in shadowing if is_under_test(source, name, solutions)]
    for name, kind, value in bindings:
        if hasattr(builtins, name) and name not in under_test:
            continue  # the real builtin
        if kind == "module":
            module = _import(_str(value))
            if module is not None:  # else the case gets a NameError, as it would without the import
                namespace[name] = module
            continue
        decoded = channel.codec.dec(value)
        if isinstance(decoded, CandidateObject):
            channel.names[decoded._ref] = name
        if isinstance(decoded, CandidateObject) and name + "." in source and used_as_module(source, name) \
                and _module_exists(name):
            channel.refusal = ("the case uses %r as a module, and the solution binds it to a %s instead"
                               % (name, decoded._type))
            raise Refused()
        namespace[name] = decoded


_SITE = []


def _with_site(find):
    """`find()`, then once more with site-packages on the path: the evaluator starts without them
    (python -S saves 5 ms a task) and adds them only for a module that needs them."""
    found = find()
    if found is None and not _SITE:
        _SITE.append(True)
        import site
        site.main()
        found = find()
    return found


def _import(name):
    def find():
        try:
            __import__(name)
            return sys.modules[name]
        except ImportError:
            return None
    return _with_site(find)


def _module_exists(name):
    def find():
        for finder in sys.meta_path:
            try:
                if getattr(finder, "find_spec", None) and finder.find_spec(name, None) is not None:
                    return True
            except (ImportError, ValueError):
                pass
        return None
    return bool(_with_site(find))


def verdict_of(exc, channel, path):
    if isinstance(exc, (ProtocolError, EOFError)):
        return ("broken", str(exc) or "the candidate's process closed its channel", "")
    if isinstance(exc, Gone) or channel.gone:
        return ("gone", "", "")
    if channel.refusal:
        return ("refused", channel.refusal, "")
    try:
        import traceback
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:  # from the case's own line on
            tb = tb.tb_next
        shown = "".join(traceback.format_exception(type(exc), exc, tb))[-2000:]
    except BaseException:
        shown = ""
    if isinstance(exc, AssertionError):
        return ("failed", "", shown)
    if isinstance(exc, (SolutionExit, SystemExit)):
        return ("exited", "", shown)
    if isinstance(exc, SolutionError):
        return ("raised", str(exc).split(":", 1)[0], shown)
    return ("raised", "".join(type(exc).__name__.split()) or "?", shown)


def evaluator(cases_path, mode, pyc):
    """Each case of the file in turn, each against the candidate whose channel the grader hands over for
    it (stdin: a Unix socket on which each case's pipes come); first, with `pyc`, this file compiled for
    the candidates' fresh interpreters."""
    import _socket
    scratch = os.path.dirname(os.path.abspath(cases_path))
    with open(cases_path, "rb") as f:
        cases = Codec.plain.dec(f.read())
    channel_out = os.dup(1)
    os.dup2(2, 1)  # a case's prints must not reach the channel
    grader = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a case reading stdin reads nothing
    os.close(null)
    if pyc:
        send_frame(channel_out, COMPILED, compiled())
    channel = EvaluatorChannel(mode == "strict")
    for index, source in enumerate(cases):
        pipes = candidate_channel(grader)
        if pipes is None:  # the grader is done with this task
            break
        channel.fd_in, channel.fd_out = pipes
        channel.codec.objects.clear()
        channel.codec.refs.clear()
        channel.names.clear()
        channel.answered.clear()
        channel.drawn.clear()
        channel.case = index
        recorded = len(channel.recorded)
        verdict = evaluate(channel, index, source, scratch)
        for fd in pipes:  # the candidate's stdin ends: it leaves
            os.close(fd)
        _flush()
        for line in channel.recorded[recorded:]:
            send_frame(channel_out, EVIDENCE, line)
        send_frame(channel_out, VERDICT, verdict)
    os._exit(0)


def candidate_channel(grader):
    """The next case's (from the candidate, to the candidate) pipes, as the grader sends them (one message,
    their two descriptors); None when it sends no more."""
    import _socket
    _, ancillary, _, _ = grader.recvmsg(16, _socket.CMSG_LEN(2 * 4))
    fds = [fd for level, kind, data in ancillary if (level, kind) == (_socket.SOL_SOCKET, _socket.SCM_RIGHTS)
           for fd in memoryview(data[:len(data) - len(data) % 4]).cast("i")]
    if len(fds) == 2:
        return fds
    for fd in fds:
        os.close(fd)
    return None


def compiled():
    """This file as bytecode for this interpreter, for the candidate's runs of this task: compiling it
    costs each run 5 ms."""
    import marshal
    magic = sys.modules["_frozen_importlib_external"].MAGIC_NUMBER
    with open(__file__) as f:
        code = compile(f.read(), __file__, "exec", dont_inherit=True)
    header = bytes(12 if sys.version_info >= (3, 7) else 8)  # flags (from 3.7), mtime, size: unused here
    return (magic, magic + header + marshal.dumps(code))


def _show_exception():
    try:
        import traceback
        traceback.print_exc()
    except BaseException:
        pass


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


Codec.plain = Codec(None, None, None)

if __name__ == "__ib_program__" and sys.flags.no_site:
    # The evaluators' zygote (assert_cases.py starts evaluators with -S, candidates without): what each of its
    # jobs would import otherwise, imported once. ast alone, with the enum and contextlib it imports, cost every
    # task 8 ms; a candidate's zygote never holds it (0.9 MB more of a zygote is more of each job's fork).
    import ast  # noqa: F401


def zygote_job():
    if sys.argv[1] == "candidate":
        candidate(sys.argv[2])
    else:
        evaluator(sys.argv[2], sys.argv[3], sys.argv[4:] == ["pyc"])


if __name__ == "__main__":
    zygote_job()
