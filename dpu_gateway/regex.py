"""Regular expressions to byte patterns (``dpu_gateway/grammar.py``): ``structured_outputs.regex`` and
``guided_regex`` (the whole answer matches), JSON Schema's ``pattern`` and ``format`` (a string's value matches).

The syntax is Python's ``re`` and ECMAScript's: literals, ``.``, classes (``[a-z]``,
``[^...]``, ``\\d \\w \\s`` and their negations, inside classes too), groups (``(...)``, ``(?:...)``, named),
alternation, the quantifiers ``* + ? {n} {n,} {n,m}`` (lazy forms too: the same strings match), escapes
(``\\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH \\u{H...} \\UHHHHHHHH`` and escaped punctuation), and ``^`` / ``$`` /
``\\A`` / ``\\Z`` / ``\\z`` where they change nothing (at the start and end: the whole text must match).
What would change the language and is not compiled is refused (``RegexError`` naming it): backreferences,
lookaround, word boundaries, flags, possessive quantifiers and atomic groups, Unicode property classes.

Where the two dialects give one construct different sets the compiled set is their common part, so every
answer matches the pattern under either (Python's ``re`` on text, ECMAScript with the ``u`` flag, as JSON
Schema asks): ``\\d``, ``\\w`` and ``\\s`` are ASCII, and their negations (``\\D``, ``[^\\d]``, ...) leave out
whatever either dialect counts in them (Unicode digits, letters and white space); ``.`` excludes the line
terminators of both (``\\n \\r`` U+2028 U+2029). A construct only one dialect accepts (``\\A``, ``(?P<n>...)``;
``\\u{...}``, ``(?<n>...)``) means what it means there.

A character set is a sorted list of disjoint inclusive ranges of code points, never a surrogate; it becomes
the alternatives of its UTF-8 encodings, a byte range per position (``utf8_ranges``). In ``json`` mode a
character is written as it appears inside a JSON string: ``"``, ``\\`` and the controls escaped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from dpu_gateway.grammar import Pat, alt, byteset, lit, rep, seq
from shared.token_dfa import GrammarError

MAX_CODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
MAX_REPEAT = 1000  # a bound of {n,m} above this is refused before anything is built (each copy is states)
MAX_NESTING = 64  # groups inside groups: deeper is refused (the parser and the build recurse)
MAX_PATTERN = 16_384  # characters of one pattern: longer is refused before it is read

Ranges = list[tuple[int, int]]


class RegexError(GrammarError):
    """A pattern this server cannot enforce (a syntax error, or a construct that is not compiled)."""

    def __init__(self, message: str, keyword: str = "") -> None:
        super().__init__(message)
        self.keyword = keyword


# ------------------------------------------------------------------------------------------------ sets
def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged, surrogates taken out."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return out


def complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE:
        out.append((start, MAX_CODE))
    return normalize(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    return complement([*complement(a), *complement(b)])


def chars(text: str) -> Ranges:
    return normalize((ord(c), ord(c)) for c in text)


def where(test: Callable[[str], bool]) -> Ranges:
    """The code points (surrogates aside) for which ``test`` holds."""
    out: Ranges = []
    start = -1
    for c in range(MAX_CODE + 2):
        ok = c <= MAX_CODE and not SURROGATES[0] <= c <= SURROGATES[1] and test(chr(c))
        if ok and start < 0:
            start = c
        elif not ok and start >= 0:
            out.append((start, c - 1))
            start = -1
    return normalize(out)


# A shorthand has a narrow set, what both dialects put in it (ASCII digits, word characters and white space),
# and a wide one, what either may (Python's Unicode \d \w \s; ECMAScript's \s, which has U+FEFF). A class
# takes the narrow sets; a negation leaves out the wide ones, so that no answer has a character one dialect
# would exclude.
DIGITS = [(0x30, 0x39)]
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = chars(" \t\n\r\f\v")
ECMA_SPACE = normalize([*SPACE, (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                        (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
DOT = complement(chars("\n\r\u2028\u2029"))
ANY = complement([])


@functools.cache
def wide(kind: str) -> Ranges:
    """The wide set of ``\\d``, ``\\w`` or ``\\s`` (computed once a process: a walk over every code point)."""
    if kind == "d":
        return normalize([*DIGITS, *where(str.isdecimal)])
    if kind == "w":
        return normalize([*WORD, *where(str.isalnum)])
    return normalize([*ECMA_SPACE, *where(str.isspace)])


def shorthand(c: str) -> tuple[Ranges, Ranges]:
    """(narrow, wide) of the shorthand ``c``, one of ``dDwWsS``."""
    narrow = {"d": DIGITS, "w": WORD, "s": SPACE}[c.lower()]
    if c.islower():
        return narrow, wide(c)
    return complement(wide(c.lower())), complement(narrow)


def utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of code points ``lo..hi`` (no surrogate between them) as sequences of byte ranges:
    a code point is in the range exactly when its encoding is in one sequence's product of ranges."""
    out: list[list[tuple[int, int]]] = []
    for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE)):
        if max(lo, a) <= min(hi, b):
            _same_length(max(lo, a), min(hi, b), out)
    return out


def _same_length(lo: int, hi: int, out: list[list[tuple[int, int]]]) -> None:
    """Split ``lo..hi`` (encodings of one length) until, at each position, every byte between lo's and hi's
    is allowed whatever the bytes before: then the sequence is one range a position."""
    for i in range(1, 4):
        tail = (1 << (6 * i)) - 1
        if lo & ~tail == hi & ~tail:
            continue
        if lo & tail:
            _same_length(lo, lo | tail, out)
            _same_length((lo | tail) + 1, hi, out)
            return
        if hi & tail != tail:
            _same_length(lo, (hi & ~tail) - 1, out)
            _same_length(hi & ~tail, hi, out)
            return
    out.append(list(zip(chr(lo).encode(), chr(hi).encode(), strict=True)))


_JSON_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
JSON_ESCAPED = normalize([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])  # written escaped inside a JSON string


def set_pattern(ranges: Ranges, json: bool = False) -> Pat:
    """The pattern of one character of ``ranges``: its UTF-8 bytes, or (``json``) the character as written
    inside a JSON string (``"``, ``\\`` and controls escaped, as ``json.dumps`` writes them)."""
    parts: list[Pat] = []
    if json:
        escaped = intersect(ranges, JSON_ESCAPED)
        parts += [lit(_JSON_SHORT.get(c, f"\\u{c:04x}")) for lo, hi in escaped for c in range(lo, hi + 1)]
        ranges = intersect(ranges, complement(JSON_ESCAPED))
    single: list[int] = []
    for lo, hi in ranges:
        for spans in utf8_ranges(lo, hi):
            if len(spans) == 1:
                single += range(spans[0][0], spans[0][1] + 1)
            else:
                parts.append(seq(*(byteset(range(a, b + 1)) for a, b in spans)))
    if single:
        parts.append(byteset(single))
    if not parts:
        raise RegexError("the pattern has a character class that matches no character")
    return parts[0] if len(parts) == 1 else alt(*parts)


# ------------------------------------------------------------------------------------------------ parser
# The tree: ("set", ranges) | ("seq", [node]) | ("alt", [node]) | ("rep", node, lo, hi) | ("start", at) | ("end", at)
Node = tuple


class _Parser:
    def __init__(self, source: str, keyword: str, sets: bool = True) -> None:
        self.sets = sets  # False: a syntax check only (no shorthand's wide set is computed)
        self.src = source
        self.pos = 0
        self.depth = 0
        self.keyword = keyword

    def fail(self, what: str, at: int | None = None) -> RegexError:
        at = self.pos if at is None else at
        return RegexError(f"regular expression {self.src!r} at position {at}: {what}", self.keyword)

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else ""

    def take(self) -> str:
        c = self.peek()
        if not c:
            raise self.fail("the pattern ends too early")
        self.pos += 1
        return c

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < len(self.src):
            raise self.fail("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.peek() and self.peek() not in "|)":
            at = self.pos
            atom = self.atom()
            items.append(self.quantified(atom, at))
        return ("seq", items)

    def quantified(self, atom: Node, at: int) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if atom[0] in ("start", "end"):
            raise self.fail("an anchor cannot be repeated", at)
        lo, hi = bounds
        if self.peek() == "?":  # lazy: the same strings match
            self.pos += 1
        elif self.peek() == "+":
            raise self.fail("possessive quantifiers are not supported")
        if self.quantifier(peek_only=True) is not None:
            raise self.fail("multiple repeat")
        return ("rep", atom, lo, hi)

    def quantifier(self, peek_only: bool = False) -> tuple[int, int | None] | None:
        c = self.peek()
        simple = {"*": (0, None), "+": (1, None), "?": (0, 1)}
        if c in simple:
            if not peek_only:
                self.pos += 1
            return simple[c]
        if c != "{":
            return None
        close = self.src.find("}", self.pos)
        body = self.src[self.pos + 1:close] if close > 0 else ""
        lo_text, comma, hi_text = body.partition(",")
        if not _number(lo_text) or (hi_text and not _number(hi_text)):
            if not lo_text and comma and (not hi_text or _number(hi_text)):
                raise self.fail("'{,n}' and '{,}' mean 0 to n (or more) in Python and a literal in ECMAScript: "
                                "write {0,n} or *")
            return None  # a literal '{' (both dialects; non-ASCII digits too)
        if len(lo_text) > 4 or len(hi_text) > 4:
            raise self.fail(f"repeat bounds above {MAX_REPEAT} are not enforced by this server")
        lo, hi = int(lo_text), (int(hi_text) if hi_text else None) if comma else int(lo_text)
        if hi is not None and hi < lo:
            raise self.fail(f"the repeat bound {{{body}}} has min > max")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.fail(f"repeat bounds above {MAX_REPEAT} are not enforced by this server")
        if not peek_only:
            self.pos = close + 1
        return lo, hi

    def atom(self) -> Node:
        c = self.take()
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", DOT)
        if c == "^":
            return ("start", self.pos - 1)
        if c == "$":
            return ("end", self.pos - 1)
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            raise self.fail("nothing to repeat", self.pos - 1)
        if c == "{" and self.quantifier_at(self.pos - 1):
            raise self.fail("nothing to repeat", self.pos - 1)
        return ("set", chars(self._checked(c)))

    def quantifier_at(self, i: int) -> bool:
        saved, self.pos = self.pos, i
        try:
            return self.quantifier(peek_only=True) is not None
        finally:
            self.pos = saved

    def _checked(self, c: str) -> str:
        if SURROGATES[0] <= ord(c) <= SURROGATES[1]:
            raise self.fail("a lone surrogate is not a character")
        return c

    def group(self) -> Node:
        start = self.pos - 1
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.fail(f"groups nested more than {MAX_NESTING} deep are not enforced by this server", start)
        if self.peek() == "?":
            self.pos += 1
            kind = self.take()
            if kind == ":":
                pass
            elif kind == "P" and self.peek() == "<" or kind == "<" and self.peek() not in "=!":
                if kind == "P":
                    self.pos += 1
                end = self.src.find(">", self.pos)
                if end < 0 or not self.src[self.pos:end].isidentifier():
                    raise self.fail("bad group name", start)
                self.pos = end + 1
            elif kind == "#":
                end = self.src.find(")", self.pos)
                if end < 0:
                    raise self.fail("missing ')', unterminated comment", start)
                self.pos = end + 1
                return ("seq", [])
            else:
                what = {"=": "lookahead is", "!": "lookahead is", "<": "lookbehind is", ">": "atomic groups are",
                        "P": "named backreferences are", "(": "conditional groups are"}.get(kind, "inline flags are")
                raise self.fail(f"{what} not supported", start)
        node = self.alternation()
        if self.peek() != ")":
            raise self.fail("missing ')'", start)
        self.pos += 1
        self.depth -= 1
        return node

    def escape(self, in_class: bool) -> Node:
        at = self.pos - 1
        c = self.take()
        if c in "dDwWsS":
            return ("set", *shorthand(c)) if self.sets else ("set", DIGITS, DIGITS)
        if not in_class and c == "A":
            return ("start", at)
        if not in_class and c in "Zz":
            return ("end", at)
        if c == "b" and in_class:
            return ("set", [(8, 8)])
        if c in "bB":
            raise self.fail("word boundaries (\\b, \\B) are not supported", at)
        if c.isdigit() and c != "0" or c == "k":
            raise self.fail("backreferences are not supported", at)
        if c in "pP":
            raise self.fail("Unicode property classes (\\p{...}) are not supported", at)
        simple = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}
        if c in simple:
            if c == "0" and self.peek().isdigit():
                raise self.fail("octal escapes are not supported", at)
            return ("set", chars(simple[c]))
        if c in "xuU":
            return ("set", [self._code(c, at)])
        if c == "c" and self.peek().isalpha() and self.peek().isascii():
            code = ord(self.take()) % 32
            return ("set", [(code, code)])
        if c.isascii() and c.isalnum():
            raise self.fail(f"bad escape \\{c}", at)
        return ("set", chars(self._checked(c)))

    def _code(self, kind: str, at: int) -> tuple[int, int]:
        if kind == "u" and self.peek() == "{":
            end = self.src.find("}", self.pos)
            digits = self.src[self.pos + 1:end] if end > 0 else ""
            self.pos = end + 1 if end > 0 else self.pos
        else:
            n = {"x": 2, "u": 4, "U": 8}[kind]
            digits = self.src[self.pos:self.pos + n]
            if len(digits) != n:
                digits = ""
            self.pos += n
        code = int(digits, 16) if digits and all(d in "0123456789abcdefABCDEF" for d in digits) else -1
        if not 0 <= code <= MAX_CODE or SURROGATES[0] <= code <= SURROGATES[1]:
            raise self.fail(f"bad escape \\{kind}: not a character's code", at)
        return (code, code)

    def char_class(self) -> Ranges:
        """The characters of a class: what each item surely means, or, negated, all but what an item may."""
        start = self.pos - 1
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        if self.peek() == "]":
            raise self.fail("a ']' first in a class differs between Python and ECMAScript: write \\]", self.pos)
        narrow: Ranges = []
        wide_: Ranges = []
        while True:
            c = self.peek()
            if not c:
                raise self.fail("unterminated character set", start)
            if c == "]":
                self.pos += 1
                break
            item = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                low, high = _code_of(item), _code_of(self.class_item())
                if low is None or high is None:
                    raise self.fail("a class shorthand (\\d, \\w, \\s) cannot bound a range")
                if high < low:
                    raise self.fail("bad character range")
                item = ([(low, high)], [(low, high)])
            narrow += item[0]
            wide_ += item[1]
        return complement(wide_) if negate else normalize(narrow)

    def class_item(self) -> tuple[Ranges, Ranges]:
        """One item of a class: (what it surely means, what it may mean), one and the same but for a shorthand."""
        c = self.take()
        if c != "\\":
            code = ord(self._checked(c))
            return [(code, code)], [(code, code)]
        node = self.escape(in_class=True)
        return node[1], node[-1]


def _code_of(item: tuple[Ranges, Ranges]) -> int | None:
    """The code of a class item that is one character (a range's bound), else None."""
    narrow, wide_ = item
    return narrow[0][0] if narrow == wide_ and len(narrow) == 1 and narrow[0][0] == narrow[0][1] else None


def _number(text: str) -> bool:
    return bool(text) and all(c in "0123456789" for c in text)


# ------------------------------------------------------------------------------------------------ compile
def parse(source: str, keyword: str = "", sets: bool = True) -> Node:
    """The pattern's tree (``sets`` False: checked only, its shorthands' sets left out: the gateway's request
    path, which must not walk the code points; the compile worker builds the real tree)."""
    if not isinstance(source, str):
        raise RegexError("a regular expression must be a string", keyword)
    if len(source) > MAX_PATTERN:
        raise RegexError(f"regular expressions of more than {MAX_PATTERN} characters are not enforced by this "
                         "server", keyword)
    parser = _Parser(source, keyword, sets)
    tree = parser.parse()
    _check_anchors(tree, True, True, parser)
    return tree


def _check_anchors(node: Node, first: bool, last: bool, parser: _Parser) -> None:
    kind = node[0]
    if kind == "start" and not first:
        raise parser.fail("'^' (or \\A) is only served at the start of the pattern", node[1])
    if kind == "end" and not last:
        raise parser.fail("'$' (or \\Z) is only served at the end of the pattern", node[1])
    if kind == "alt":
        for branch in node[1]:
            _check_anchors(branch, first, last, parser)
    elif kind == "seq":
        items = node[1]
        # an item is first when only starts come before it, last when only ends follow it
        lead = next((i for i, x in enumerate(items) if x[0] != "start"), len(items))
        tail = next((i for i in range(len(items) - 1, -1, -1) if items[i][0] != "end"), -1)
        for i, item in enumerate(items):
            _check_anchors(item, first and i <= lead, last and i >= tail, parser)
    elif kind == "rep":
        _check_anchors(node[1], False, False, parser)


def pattern(source: str, json: bool = False, keyword: str = "") -> Pat:
    """The byte pattern of the text ``source`` matches whole (``json``: as written inside a JSON string)."""
    return _build(parse(source, keyword), json)


def _build(node: Node, json: bool) -> Pat:
    kind = node[0]
    if kind == "set":
        return set_pattern(node[1], json)
    if kind in ("start", "end"):
        return seq()
    if kind == "seq":
        return seq(*(_build(n, json) for n in node[1]))
    if kind == "alt":
        return alt(*(_build(n, json) for n in node[1]))
    return rep(_build(node[1], json), node[2], node[3])
