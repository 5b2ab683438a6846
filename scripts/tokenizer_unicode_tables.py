#!/usr/bin/env python3
"""Generates src/tokenizer/unicode_tables.rs: the Unicode classes the pre-tokenizers need, and the two
mappings BERT's normalizer needs (accent stripping and lower-casing).

Every code point 0..=0x10FFFF gets one class from its General Category (Python's unicodedata), the same
grouping llama.cpp's unicode-data.cpp uses (its scripts/gen-unicode-data.py maps categories to flags):

    Cn -> UNDEFINED            Nd Nl No -> NUMBER        Lu Ll Lt Lm Lo -> LETTER
    Zs Zl Zp -> SEPARATOR      Mn Mc Me -> MARK          Pc Pd Ps Pe Pi Pf Po -> PUNCTUATION
    Sm Sc Sk So -> SYMBOL      Cc Cf Cs Co -> CONTROL

except that nonspacing marks (Mn) get a class of their own, NONSPACING (BERT strips only those), which
llama.cpp's table counts as MARK.

Ranges given in UnicodeData.txt as "<..., First>" / "<..., Last>" pairs (CJK ideographs, Hangul
syllables, Tangut, private use, surrogates) are single categories in unicodedata, so they need no special
case here. Whitespace is not a category: it is the White_Space property of PropList.txt, which Python
does not expose, so the list is written out below (the same list llama.cpp uses).

The table is a sorted list of range starts with one class per range (a range runs to the next start),
searched by binary search; code points below 0x80 also get a direct table.

WordPiece (BERT) normalization, as HF tokenizers' BertNormalizer does it per character:
* accent stripping is NFD with the nonspacing marks (Mn) dropped. Listed are the code points whose
  result is not the code point itself and that are not Mn themselves (those are simply dropped):
  results of one code point in STRIP_BMP_* (both ends in the BMP) and STRIP_ASTRAL_*, the few of two
  or three code points (Indic vowel signs, musical symbols) in STRIP_MULTI_*. Hangul syllables
  decompose by arithmetic (Unicode 3.12) and are not listed.
* lower-casing is the simple lowercase mapping (Python's str.lower of one character, but U+0130,
  whose full mapping "i" + U+0307 the Rust side adds, maps to "i"), as runs of
  code points spaced 1 or 2 apart that move by the same delta: LOWER_RUNS packs start << 11 |
  count << 1 | (spacing - 1), LOWER_DELTA the delta.
The generator checks both tables against unicodedata for every code point before writing them.

    python3.13 scripts/tokenizer_unicode_tables.py > src/tokenizer/unicode_tables.rs
    python3.13 scripts/tokenizer_unicode_tables.py --compare path/to/llama.cpp/src/unicode-data.cpp

--compare prints the code points whose class differs from llama.cpp's generated table (that table is
built from the newest UnicodeData.txt of its day: use a Python whose Unicode version is at least as new).
"""
import re
import sys
import unicodedata

MAX_CODEPOINTS = 0x110000

# Class numbers, also the values of `Class` in src/tokenizer/unicode.rs.
UNDEFINED, NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL, NONSPACING = range(9)
CLASS_NAMES = ["Undefined", "Number", "Letter", "Separator", "Mark", "Punctuation", "Symbol", "Control",
               "Nonspacing"]

CATEGORY_CLASS = {
    "Cn": UNDEFINED,
    "Cc": CONTROL, "Cf": CONTROL, "Co": CONTROL, "Cs": CONTROL,
    "Ll": LETTER, "Lm": LETTER, "Lo": LETTER, "Lt": LETTER, "Lu": LETTER,
    "Mc": MARK, "Me": MARK, "Mn": NONSPACING,
    "Nd": NUMBER, "Nl": NUMBER, "No": NUMBER,
    "Pc": PUNCTUATION, "Pd": PUNCTUATION, "Pe": PUNCTUATION, "Pf": PUNCTUATION,
    "Pi": PUNCTUATION, "Po": PUNCTUATION, "Ps": PUNCTUATION,
    "Sc": SYMBOL, "Sk": SYMBOL, "Sm": SYMBOL, "So": SYMBOL,
    "Zl": SEPARATOR, "Zp": SEPARATOR, "Zs": SEPARATOR,
}

# PropList.txt White_Space.
WHITESPACE = list(range(0x09, 0x0E)) + [0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) + [
    0x2028, 0x2029, 0x202F, 0x205F, 0x3000]

# llama.cpp's Llama-3 style pre-tokenizers compare unicode_tolower(c) with these letters for the
# contractions 's 't 're 've 'm 'll 'd. The Rust side only lowercases ASCII: check that no other code
# point has one of them as its simple lowercase mapping.
CONTRACTION_LETTERS = set("stmdrevl")


def classes():
    return [CATEGORY_CLASS[unicodedata.category(chr(c))] for c in range(MAX_CODEPOINTS)]


def ranges(cls):
    out = [(0, cls[0])]
    for c in range(1, MAX_CODEPOINTS):
        if cls[c] != out[-1][1]:
            out.append((c, cls[c]))
    return out


def check_lowercase():
    for c in range(0x80, MAX_CODEPOINTS):
        low = chr(c).lower()
        if len(low) == 1 and low in CONTRACTION_LETTERS:
            sys.exit(f"U+{c:04X} lowercases to {low!r}: unicode.rs must lowercase more than ASCII")


HANGUL_FIRST, HANGUL_LAST = 0xAC00, 0xD7A3


def strip_accents(c):
    """NFD of one code point without its nonspacing marks (BertNormalizer's strip_accents)."""
    return [ord(x) for x in unicodedata.normalize("NFD", chr(c)) if unicodedata.category(x) != "Mn"]


def strip_tables():
    bmp, astral, multi = [], [], []
    for c in range(MAX_CODEPOINTS):
        if HANGUL_FIRST <= c <= HANGUL_LAST or unicodedata.category(chr(c)) == "Mn":
            continue
        s = strip_accents(c)
        if s == [c]:
            continue
        if len(s) == 1:
            (bmp if c <= 0xFFFF and s[0] <= 0xFFFF else astral).append((c, s[0]))
        else:
            assert len(s) <= 3, hex(c)
            multi.append((c, s + [0] * (3 - len(s))))
    return bmp, astral, multi


def hangul_decompose(c):
    s = c - HANGUL_FIRST
    lv = [0x1100 + s // 588, 0x1161 + (s % 588) // 28]
    return lv + ([0x11A7 + s % 28] if s % 28 else [])


def check_strip(bmp, astral, multi):
    """The Rust lookup (tables, then Hangul arithmetic, then Mn dropped) against unicodedata."""
    table = dict(bmp) | dict(astral)
    table_multi = {c: [x for x in s if x] for c, s in multi}
    for c in range(MAX_CODEPOINTS):
        if 0xD800 <= c <= 0xDFFF:
            continue
        if unicodedata.category(chr(c)) == "Mn":
            got = []
        elif HANGUL_FIRST <= c <= HANGUL_LAST:
            got = hangul_decompose(c)
        else:
            got = table_multi.get(c, [table.get(c, c)])
        if got != strip_accents(c):
            sys.exit(f"strip tables wrong at U+{c:04X}: {got} vs {strip_accents(c)}")


def lower_runs():
    low = {}
    for c in range(MAX_CODEPOINTS):
        l = chr(c).lower()
        if l != chr(c) and c != 0x130:
            assert len(l) == 1, hex(c)
            low[c] = ord(l)
    low[0x130] = 0x69  # its simple mapping (UnicodeData.txt); str.lower gives the full "i\u0307"
    runs = []  # [start, count, spacing, delta]
    for c in sorted(low):
        d = low[c] - c
        if runs:
            r = runs[-1]
            if r[3] == d and r[1] < 1023 and c == r[0] + r[1] * r[2]:
                r[1] += 1
                continue
            if r[3] == d and r[1] == 1 and c - r[0] == 2:
                r[1], r[2] = 2, 2
                continue
        runs.append([c, 1, 1, d])
    expanded = {start + k * spacing: start + k * spacing + delta
                 for start, count, spacing, delta in runs for k in range(count)}
    if expanded != low:
        sys.exit("lower runs do not give the lowercase mapping")
    return runs


def llama_cpp_classes(path):
    """Classes from llama.cpp's unicode-data.cpp (its unicode_ranges_flags table)."""
    text = open(path, encoding="utf-8").read()
    body = text.split("unicode_ranges_flags", 1)[1].split("};", 1)[0]
    pairs = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", body)]
    flag_class = {0x01: UNDEFINED, 0x02: NUMBER, 0x04: LETTER, 0x08: SEPARATOR, 0x10: MARK,
                  0x20: PUNCTUATION, 0x40: SYMBOL, 0x80: CONTROL}
    cls = [UNDEFINED] * MAX_CODEPOINTS
    for (start, flags), (end, _) in zip(pairs, pairs[1:]):
        for c in range(start, min(end, MAX_CODEPOINTS)):
            cls[c] = flag_class[flags & 0xFF]
    return cls


def rows(w, values, per_line, fmt):
    for i in range(0, len(values), per_line):
        w("    " + " ".join(fmt(v) + "," for v in values[i:i + per_line]) + "\n")


def emit(rng, bmp, astral, multi, runs):
    py = sys.version.split()[0]
    uv = unicodedata.unidata_version
    w = sys.stdout.write
    w(f"//! Unicode classes for the pre-tokenizers, and BERT's accent stripping and lower-casing. GENERATED\n")
    w(f"//! by scripts/tokenizer_unicode_tables.py with Python {py} (Unicode {uv}); do not edit by hand.\n\n")
    w(f"/// Unicode version of the tables.\npub const UNICODE_VERSION: &str = \"{uv}\";\n\n")
    w(f"/// Number of ranges.\npub(crate) const N_RANGES: usize = {len(rng)};\n\n")
    w("/// First code point of each range, ascending; a range runs to the next start (the last to 0x10FFFF).\n")
    w("#[rustfmt::skip]\npub(crate) static RANGE_START: [u32; N_RANGES] = [\n")
    for i in range(0, len(rng), 10):
        w("    " + " ".join(f"0x{s:05X}," for s, _ in rng[i:i + 10]) + "\n")
    w("];\n\n")
    w("/// Class of each range (0 Undefined, 1 Number, 2 Letter, 3 Separator, 4 Mark, 5 Punctuation,\n")
    w("/// 6 Symbol, 7 Control, 8 Nonspacing mark).\n")
    w("#[rustfmt::skip]\npub(crate) static RANGE_CLASS: [u8; N_RANGES] = [\n")
    for i in range(0, len(rng), 32):
        w("    " + " ".join(f"{c}," for _, c in rng[i:i + 32]) + "\n")
    w("];\n\n")
    w("/// White_Space code points (PropList.txt), ascending.\n")
    w("#[rustfmt::skip]\npub(crate) static WHITESPACE: [u32; %d] = [\n" % len(WHITESPACE))
    ws = sorted(WHITESPACE)
    for i in range(0, len(ws), 10):
        w("    " + " ".join(f"0x{c:04X}," for c in ws[i:i + 10]) + "\n")
    w("];\n\n")
    hexes = lambda v: f"0x{v:04X}"
    for name, table, ty in (("BMP", bmp, "u16"), ("ASTRAL", astral, "u32")):
        w(f"/// Accent stripping to one code point ({name}): the code points, ascending...\n")
        w(f"#[rustfmt::skip]\npub(crate) static STRIP_{name}_FROM: [{ty}; {len(table)}] = [\n")
        rows(w, [c for c, _ in table], 10, hexes)
        w("];\n\n/// ...and their letters without accents.\n")
        w(f"#[rustfmt::skip]\npub(crate) static STRIP_{name}_TO: [{ty}; {len(table)}] = [\n")
        rows(w, [s for _, s in table], 10, hexes)
        w("];\n\n")
    w("/// Accent stripping to two or three code points: the code points, ascending...\n")
    w(f"#[rustfmt::skip]\npub(crate) static STRIP_MULTI_FROM: [u32; {len(multi)}] = [\n")
    rows(w, [c for c, _ in multi], 10, hexes)
    w("];\n\n/// ...and what they become (0 past the end).\n")
    w(f"#[rustfmt::skip]\npub(crate) static STRIP_MULTI_TO: [[u32; 3]; {len(multi)}] = [\n")
    rows(w, [s for _, s in multi], 3, lambda s: "[" + ", ".join(hexes(x) for x in s) + "]")
    w("];\n\n")
    w("/// Simple lowercase mapping: runs of code points, `start << 11 | count << 1 | (spacing - 1)`...\n")
    w(f"#[rustfmt::skip]\npub(crate) static LOWER_RUNS: [u32; {len(runs)}] = [\n")
    rows(w, [r[0] << 11 | r[1] << 1 | (r[2] - 1) for r in runs], 8, lambda v: f"0x{v:08X}")
    w("];\n\n/// ...and how far each run's code points move.\n")
    w(f"#[rustfmt::skip]\npub(crate) static LOWER_DELTA: [i32; {len(runs)}] = [\n")
    rows(w, [r[3] for r in runs], 12, str)
    w("];\n")


def main():
    if unicodedata.unidata_version != "15.1.0":
        print(f"warning: Python {sys.version.split()[0]} has Unicode {unicodedata.unidata_version}; the committed "
              "table is Unicode 15.1.0 (Python 3.13), which matches llama.cpp's unicode-data.cpp exactly",
              file=sys.stderr)
    check_lowercase()
    cls = classes()
    if len(sys.argv) == 3 and sys.argv[1] == "--compare":
        ref = llama_cpp_classes(sys.argv[2])
        cls = [MARK if c == NONSPACING else c for c in cls]
        diff = [c for c in range(MAX_CODEPOINTS) if cls[c] != ref[c]]
        print(f"Unicode {unicodedata.unidata_version}: {len(diff)} code points differ from {sys.argv[2]}")
        for c in diff[:40]:
            print(f"  U+{c:04X} ours {CLASS_NAMES[cls[c]]}, llama.cpp {CLASS_NAMES[ref[c]]}")
        sys.exit(1 if diff else 0)
    if len(sys.argv) != 1:
        sys.exit(__doc__)
    bmp, astral, multi = strip_tables()
    check_strip(bmp, astral, multi)
    runs = lower_runs()
    emit(ranges(cls), bmp, astral, multi, runs)


if __name__ == "__main__":
    main()
