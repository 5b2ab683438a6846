//! Hand-written pre-tokenizers: they cut text into the words BPE then works on, exactly as the
//! regular expressions llama.cpp uses for each `tokenizer.ggml.pre` (`llama-vocab.cpp`,
//! `LLAMA_VOCAB_PRE_TYPE_*`), as llama.cpp evaluates them (`unicode.cpp`):
//!
//! * GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (llama.cpp's
//!   hand-written `unicode_regex_split_custom_gpt2`, which also takes a lone `\s+` at the end).
//! * Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//!   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
//! * Qwen2: Llama 3 with single digits `\p{N}`; Qwen3.5: Qwen2 with `[\p{L}\p{M}]` for letters.
//! * GPT-4o (Phi-4-mini, Llama 4): `[^\r\n\p{L}\p{N}]?U*L+C?|[^\r\n\p{L}\p{N}]?U+L*C?|\p{N}{1,3}|
//!   ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+` with `U` a letter but `a-z`, `L` a letter but
//!   `A-Z` (llama.cpp's `(?=[\p{L}])([^a-z])`: over its collapsed text every non-ASCII letter is
//!   both) and `C` a contraction (`'s`, `'T`, `'re`...).
//! * SmolLM (also StarCoder, Refact, Command-R): first every `\p{N}` on its own, then GPT-2 on
//!   each piece.
//! * default: `[\p{P}\$\+<=>\^~\|]+`, then GPT-2, then `\p{N}+`, then `[0-9][0-9][0-9]`, each
//!   splitting the pieces of the previous one. llama.cpp runs the 1st, 3rd and 4th with
//!   `std::regex` over text whose non-ASCII code points are collapsed to one byte per class; the
//!   ASCII members of `\p{P}` are then `!"#%&'()*,-./:;?@[\]_{}`.
//!
//! A regex stage yields its matches and the text between them as separate pieces. Every function
//! here works on byte positions of valid UTF-8 and calls back with each piece in order; none
//! allocates, and each is linear in the text.

use super::unicode::{char_at, flags, Flags};
use super::TokError;

/// How text is cut into words before BPE (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PreTokenizer {
    /// GPT-2 (`gpt-2`, `gpt2`, `mpt`, `olmo`, `phi-2`...).
    Gpt2,
    /// Llama 3 (`llama-bpe`, `llama3`...): digits in groups of up to three.
    Llama3,
    /// Qwen2 (`qwen2`, `stablelm2`, `megrez`...): Llama 3 with single digits.
    Qwen2,
    /// Qwen3.5 (`qwen35`): Qwen2 with combining marks counted as letters.
    Qwen35,
    /// GPT-4o (`gpt-4o`, `llama4`...): letter runs split before an upper-case run that follows
    /// lower case, contractions kept with their word, digits in groups of up to three.
    Gpt4o,
    /// SmolLM (`smollm`, `starcoder`, `refact`, `command-r`...): single digits, then GPT-2.
    SmolLm,
    /// llama.cpp's fallback (`default`, or no `tokenizer.ggml.pre` at all).
    Default,
}

/// One accepted `tokenizer.ggml.pre` value: its splitter and the flags llama.cpp sets with it.
pub(crate) struct PreEntry {
    pub(crate) name: &'static str,
    pub(crate) pre: PreTokenizer,
    /// A word that is itself a token is taken whole, without merges (llama.cpp `ignore_merges`).
    pub(crate) ignore_merges: bool,
    /// BOS is added unless `tokenizer.ggml.add_bos_token` says otherwise.
    pub(crate) add_bos: bool,
}

const fn e(name: &'static str, pre: PreTokenizer, ignore_merges: bool, add_bos: bool) -> PreEntry {
    PreEntry { name, pre, ignore_merges, add_bos }
}

/// The `tokenizer.ggml.pre` values accepted, grouped as in llama.cpp's `llama_vocab::impl::load`.
pub(crate) static PRE_TABLE: &[PreEntry] = &[
    e("default", PreTokenizer::Default, false, false),
    e("gpt2", PreTokenizer::Gpt2, false, false),
    e("gpt-2", PreTokenizer::Gpt2, false, false),
    e("phi-2", PreTokenizer::Gpt2, false, false),
    e("mpt", PreTokenizer::Gpt2, false, false),
    e("olmo", PreTokenizer::Gpt2, false, false),
    e("exaone4", PreTokenizer::Gpt2, false, false),
    e("trillion", PreTokenizer::Gpt2, false, false),
    e("granite-docling", PreTokenizer::Gpt2, false, false),
    e("llama-bpe", PreTokenizer::Llama3, true, true),
    e("llama3", PreTokenizer::Llama3, true, true),
    e("llama-v3", PreTokenizer::Llama3, true, true),
    e("falcon3", PreTokenizer::Llama3, true, true),
    e("falcon-h1", PreTokenizer::Llama3, true, true),
    e("pixtral", PreTokenizer::Llama3, true, true),
    e("midm-2.0", PreTokenizer::Llama3, true, true),
    e("lfm2", PreTokenizer::Llama3, true, true),
    e("dbrx", PreTokenizer::Llama3, false, false),
    e("smaug-bpe", PreTokenizer::Llama3, false, false),
    e("qwen2", PreTokenizer::Qwen2, false, false),
    e("deepseek-r1-qwen", PreTokenizer::Qwen2, false, false),
    e("megrez", PreTokenizer::Qwen2, false, false),
    e("stablelm2", PreTokenizer::Qwen2, false, false),
    e("hunyuan", PreTokenizer::Qwen2, false, false),
    e("qwen35", PreTokenizer::Qwen35, false, false),
    e("gpt-4o", PreTokenizer::Gpt4o, false, false),
    e("llama4", PreTokenizer::Gpt4o, false, false),
    e("kanana2", PreTokenizer::Gpt4o, false, false),
    e("talkie", PreTokenizer::Gpt4o, false, false),
    e("smollm", PreTokenizer::SmolLm, false, false),
    e("starcoder", PreTokenizer::SmolLm, false, false),
    e("refact", PreTokenizer::SmolLm, false, false),
    e("command-r", PreTokenizer::SmolLm, false, false),
    e("codeshell", PreTokenizer::SmolLm, false, false),
    e("exaone", PreTokenizer::SmolLm, false, false),
    e("minerva-7b", PreTokenizer::SmolLm, false, false),
];

/// The entry for a `tokenizer.ggml.pre` value.
pub(crate) fn lookup_pre(name: &str) -> Option<&'static PreEntry> {
    PRE_TABLE.iter().find(|p| p.name == name)
}

/// Callback receiving each word as a byte range of the text.
pub(crate) type Sink<'f> = dyn FnMut(usize, usize) -> Result<(), TokError> + 'f;

/// Cuts `text` into words with `pre` and calls `f(start, end)` for each, in order.
pub(crate) fn split(pre: PreTokenizer, text: &str, f: &mut Sink<'_>) -> Result<(), TokError> {
    let t = text.as_bytes();
    let n = t.len();
    match pre {
        PreTokenizer::Gpt2 => gpt2(t, 0, n, f),
        PreTokenizer::Llama3 => llama3(t, 0, n, 3, false, f),
        PreTokenizer::Qwen2 => llama3(t, 0, n, 1, false, f),
        PreTokenizer::Qwen35 => llama3(t, 0, n, 1, true, f),
        PreTokenizer::Gpt4o => each_piece(t, 0, n, gpt4o_next, f),
        PreTokenizer::SmolLm => each_piece(t, 0, n, single_numbers, &mut |a, b| gpt2(t, a, b, f)),
        PreTokenizer::Default => each_piece(t, 0, n, punctuation_runs, &mut |a, b| {
            gpt2(t, a, b, &mut |c, d| {
                each_piece(t, c, d, number_runs, &mut |g, h| each_piece(t, g, h, ascii_digit_triples, f))
            })
        }),
    }
}

/// Cuts `text` into runs of newlines and runs of anything else (the split of SentencePiece-style
/// BPE, llama.cpp's `[^\n]+|[\n]+` for gemma4) and calls `f(start, end)` for each, in order.
pub(crate) fn split_newline_runs(text: &str, f: &mut Sink<'_>) -> Result<(), TokError> {
    let t = text.as_bytes();
    each_piece(t, 0, t.len(), newline_run, f)
}

/// End of the run of newlines, or of other bytes, that starts at `pos`.
fn newline_run(t: &[u8], pos: usize, hi: usize) -> usize {
    let nl = t[pos] == b'\n';
    t[pos..hi].iter().position(|&b| (b == b'\n') != nl).map_or(hi, |k| pos + k)
}

/// Flags of the character at `p`, or [`Flags::OUT`] at or past `hi`.
#[inline]
fn fl(t: &[u8], p: usize, hi: usize) -> Flags {
    if p < hi {
        flags(char_at(t, p).0)
    } else {
        Flags::OUT
    }
}

/// End of the run of characters from `p` whose flags satisfy `pred`.
#[inline]
fn run(t: &[u8], mut p: usize, hi: usize, pred: impl Fn(Flags) -> bool) -> usize {
    while p < hi {
        let (cp, len) = char_at(t, p);
        if !pred(flags(cp)) {
            break;
        }
        p += len;
    }
    p
}

/// The white-space run at `p`: (number of characters, start of its last character, end, end of its
/// last `\r` or `\n` if any).
#[inline]
fn whitespace_run(t: &[u8], p: usize, hi: usize) -> (usize, usize, usize, Option<usize>) {
    let (mut n, mut last, mut q, mut rn) = (0, p, p, None);
    while q < hi {
        let (cp, len) = char_at(t, q);
        if !flags(cp).is_whitespace() {
            break;
        }
        if cp == u32::from(b'\r') || cp == u32::from(b'\n') {
            rn = Some(q + len);
        }
        n += 1;
        last = q;
        q += len;
    }
    (n, last, q, rn)
}

/// `'s|'t|'m|'d` (2 characters) or `'re|'ve|'ll` (3) at `p`, compared after `lower`: the end of the
/// contraction if there is one.
#[inline]
fn contraction(t: &[u8], p: usize, hi: usize, lower: bool) -> Option<usize> {
    let low = |c: u32| if lower && (u32::from(b'A')..=u32::from(b'Z')).contains(&c) { c + 32 } else { c };
    let p1 = p + 1; // after the apostrophe (one byte)
    if p1 >= hi {
        return None;
    }
    let (c1, l1) = char_at(t, p1);
    let c1 = low(c1);
    if [b's', b't', b'm', b'd'].iter().any(|&x| c1 == u32::from(x)) {
        return Some(p1 + l1);
    }
    let p2 = p1 + l1;
    if p2 >= hi {
        return None;
    }
    let (c2, l2) = char_at(t, p2);
    let c2 = low(c2);
    let pair = |a: u8, b: u8| c1 == u32::from(a) && c2 == u32::from(b);
    (pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l')).then_some(p2 + l2)
}

/// GPT-2's pattern over `[lo, hi)`.
fn gpt2(t: &[u8], lo: usize, hi: usize, f: &mut Sink<'_>) -> Result<(), TokError> {
    let mut pos = lo;
    while pos < hi {
        let end = gpt2_next(t, pos, hi);
        f(pos, end)?;
        pos = end;
    }
    Ok(())
}

fn gpt2_next(t: &[u8], pos: usize, hi: usize) -> usize {
    let (c, cl) = char_at(t, pos);
    let p1 = pos + cl;
    if c == u32::from(b'\'') {
        if let Some(end) = contraction(t, pos, hi, false) {
            return end;
        }
    }
    let space = c == u32::from(b' ');
    let f2 = if space { fl(t, p1, hi) } else { flags(c) };
    let start = if space { p1 } else { pos };
    if f2.is_letter() {
        return run(t, start, hi, Flags::is_letter);
    }
    if f2.is_number() {
        return run(t, start, hi, Flags::is_number);
    }
    let other = |f: Flags| f.is_in() && !(f.is_whitespace() || f.is_letter() || f.is_number());
    if other(f2) {
        return run(t, start, hi, other);
    }
    let (n_ws, last, end, _) = whitespace_run(t, pos, hi);
    if n_ws > 1 && end < hi {
        return last; // \s+(?!\S): leave the last white space for the next word
    }
    if n_ws > 0 {
        return end;
    }
    p1
}

/// Llama 3's pattern over `[lo, hi)` with digit groups of `digits` (3 for Llama 3, 1 for Qwen2) and,
/// for Qwen3.5, marks counted with letters.
fn llama3(
    t: &[u8],
    lo: usize,
    hi: usize,
    digits: usize,
    marks: bool,
    f: &mut Sink<'_>,
) -> Result<(), TokError> {
    let mut pos = lo;
    while pos < hi {
        let end = llama3_next(t, pos, hi, digits, marks);
        f(pos, end)?;
        pos = end;
    }
    Ok(())
}

fn llama3_next(t: &[u8], pos: usize, hi: usize, digits: usize, marks: bool) -> usize {
    let (c, cl) = char_at(t, pos);
    let p1 = pos + cl;
    if c == u32::from(b'\'') {
        if let Some(end) = contraction(t, pos, hi, true) {
            return end;
        }
    }
    let f = flags(c);
    let letter = |f: Flags| f.is_letter() || (marks && f.is_mark());
    // [^\r\n\p{L}\p{N}]?\p{L}+
    let newline = c == u32::from(b'\r') || c == u32::from(b'\n');
    if !(newline || f.is_number()) && (letter(f) || letter(fl(t, p1, hi))) {
        return run(t, p1, hi, letter);
    }
    numbers_punctuation_spaces(t, pos, hi, digits, letter, b"\r\n")
}

/// The alternatives Llama 3's and GPT-4o's patterns end with, at `pos` where no letter run starts:
/// `\p{N}{1,digits}| ?[^\s\p{L}\p{N}]+[trail]*|\s*[\r\n]+|\s+(?!\S)|\s+`, with `letter` what
/// counts as `\p{L}`.
fn numbers_punctuation_spaces(
    t: &[u8],
    pos: usize,
    hi: usize,
    digits: usize,
    letter: impl Fn(Flags) -> bool,
    trail: &[u8],
) -> usize {
    let (c, cl) = char_at(t, pos);
    let (f, p1) = (flags(c), pos + cl);
    // \p{N}{1,digits}
    if f.is_number() {
        let mut p = pos;
        let mut k = 0;
        while k < digits && fl(t, p, hi).is_number() {
            p += char_at(t, p).1;
            k += 1;
        }
        return p;
    }
    // ' ?[^\s\p{L}\p{N}]+[trail]*'
    let space = c == u32::from(b' ');
    let f2 = if space { fl(t, p1, hi) } else { f };
    let other = |f: Flags| !(f.is_whitespace() || letter(f) || f.is_number());
    if other(f2) {
        let mut p = run(t, if space { p1 } else { pos }, hi, |f| f.is_in() && other(f));
        while p < hi && trail.contains(&t[p]) {
            p += 1;
        }
        return p;
    }
    // \s*[\r\n]+ | \s+(?!\S) | \s+
    let (n_ws, last, end, rn) = whitespace_run(t, pos, hi);
    if let Some(rn) = rn {
        return rn;
    }
    if n_ws > 1 && end < hi {
        return last;
    }
    if n_ws > 0 {
        return end;
    }
    p1
}

fn gpt4o_next(t: &[u8], pos: usize, hi: usize) -> usize {
    let (c, cl) = char_at(t, pos);
    let f = flags(c);
    let ascii = |c: u32, a: u8, z: u8| (u32::from(a)..=u32::from(z)).contains(&c);
    // U: a letter but a-z; L: a letter but A-Z (a non-ASCII letter is both).
    let upper = |c: u32| flags(c).is_letter() && !ascii(c, b'a', b'z');
    let lower = |c: u32| flags(c).is_letter() && !ascii(c, b'A', b'Z');
    let run_of = |mut p: usize, pred: &dyn Fn(u32) -> bool| {
        while p < hi {
            let (cp, len) = char_at(t, p);
            if !pred(cp) {
                break;
            }
            p += len;
        }
        p
    };
    let with_contraction = |end: usize| {
        if end < hi && t[end] == b'\'' {
            contraction(t, end, hi, true).unwrap_or(end)
        } else {
            end
        }
    };
    // [^\r\n\p{L}\p{N}]? then U*L+ (backtracking: the longest run of U followed by an L), else U+L*.
    let newline = c == u32::from(b'\r') || c == u32::from(b'\n');
    let start = if newline || f.is_letter() || f.is_number() { pos } else { pos + cl };
    let u_end = run_of(start, &upper);
    if u_end < hi && ascii(char_at(t, u_end).0, b'a', b'z') {
        return with_contraction(run_of(u_end, &lower));
    }
    // Within the U run the L characters are the non-ASCII letters: L+ takes the last of them
    // alone (the U characters after it are A-Z, and what follows the run is no L).
    let mut last_both = None;
    let mut p = start;
    while p < u_end {
        let (cp, len) = char_at(t, p);
        if lower(cp) {
            last_both = Some(p + len);
        }
        p += len;
    }
    if let Some(end) = last_both {
        return with_contraction(end);
    }
    if u_end > start {
        return with_contraction(run_of(u_end, &lower));
    }
    numbers_punctuation_spaces(t, pos, hi, 3, Flags::is_letter, b"\r\n/")
}

/// Calls `f` for each piece of `[lo, hi)` cut by a regex stage: `next(t, pos, hi)` gives the end of
/// the piece starting at `pos` (a match, or the text up to the next match).
fn each_piece(
    t: &[u8],
    lo: usize,
    hi: usize,
    next: fn(&[u8], usize, usize) -> usize,
    f: &mut Sink<'_>,
) -> Result<(), TokError> {
    let mut pos = lo;
    while pos < hi {
        let end = next(t, pos, hi);
        f(pos, end)?;
        pos = end;
    }
    Ok(())
}

/// `\p{N}`: each number character alone; the text between them as one piece.
fn single_numbers(t: &[u8], pos: usize, hi: usize) -> usize {
    let (cp, len) = char_at(t, pos);
    if flags(cp).is_number() {
        pos + len
    } else {
        run(t, pos, hi, |f| !f.is_number())
    }
}

/// `[\p{P}\$\+<=>\^~\|]+` over llama.cpp's collapsed text.
fn punctuation_runs(t: &[u8], pos: usize, hi: usize) -> usize {
    let member = |t: &[u8], p: usize| {
        let (cp, len) = char_at(t, p);
        let m = if cp < 0x80 {
            b"!\"#%&'()*,-./:;?@[\\]_{}$+<=>^~|".contains(&(cp as u8))
        } else {
            let f = flags(cp);
            f.is_punctuation() && !f.is_whitespace()
        };
        (m, len)
    };
    let first = member(t, pos).0;
    let mut p = pos;
    while p < hi {
        let (m, len) = member(t, p);
        if m != first {
            break;
        }
        p += len;
    }
    p
}

/// `\p{N}+`: runs of number characters, and the text between them.
fn number_runs(t: &[u8], pos: usize, hi: usize) -> usize {
    let first = flags(char_at(t, pos).0).is_number();
    run(t, pos, hi, |f| f.is_number() == first)
}

/// `[0-9][0-9][0-9]`: three ASCII digits, and the text up to the next three.
fn ascii_digit_triples(t: &[u8], pos: usize, hi: usize) -> usize {
    let triple = |p: usize| p + 3 <= hi && t[p..p + 3].iter().all(u8::is_ascii_digit);
    if triple(pos) {
        return pos + 3;
    }
    let mut p = pos;
    while p < hi && !triple(p) {
        p += char_at(t, p).1;
    }
    p
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::string::String;
    use std::vec::Vec;

    fn words(pre: PreTokenizer, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split(pre, text, &mut |a, b| {
            out.push(String::from(&text[a..b]));
            Ok(())
        })
        .unwrap();
        assert_eq!(out.concat(), text, "pieces must cover the text");
        out
    }

    #[test]
    fn gpt2_pattern() {
        assert_eq!(words(PreTokenizer::Gpt2, "Hello world"), ["Hello", " world"]);
        assert_eq!(words(PreTokenizer::Gpt2, "I'm you're"), ["I", "'m", " you", "'re"]);
        assert_eq!(words(PreTokenizer::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(PreTokenizer::Gpt2, "trailing   "), ["trailing", "   "]);
        assert_eq!(words(PreTokenizer::Gpt2, "x 123 4.5!!"), ["x", " 123", " 4", ".", "5", "!!"]);
        assert_eq!(words(PreTokenizer::Gpt2, "\n\n\tA"), ["\n\n", "\t", "A"]);
        assert_eq!(words(PreTokenizer::Gpt2, "'S"), ["'", "S"]);
        assert_eq!(words(PreTokenizer::Gpt2, "é 日本"), ["é", " 日本"]);
    }

    #[test]
    fn llama3_pattern() {
        let w = |s| words(PreTokenizer::Llama3, s);
        assert_eq!(w("Hello world"), ["Hello", " world"]);
        assert_eq!(w("I'M"), ["I", "'M"]);
        assert_eq!(w("1234567"), ["123", "456", "7"]);
        assert_eq!(w(" 12"), [" ", "12"]);
        assert_eq!(w("a \n\n b"), ["a", " \n\n", " b"]);
        assert_eq!(w("(x)\n\ny"), ["(x", ")\n\n", "y"]);
        assert_eq!(w("foo   "), ["foo", "   "]);
        assert_eq!(w("foo   bar"), ["foo", "  ", " bar"]);
        assert_eq!(w("\tbar"), ["\tbar"]);
    }

    #[test]
    fn qwen2_and_smollm_digits() {
        assert_eq!(words(PreTokenizer::Qwen2, "x=123"), ["x", "=", "1", "2", "3"]);
        assert_eq!(words(PreTokenizer::SmolLm, "ab12 c"), ["ab", "1", "2", " c"]);
        assert_eq!(words(PreTokenizer::SmolLm, "a 1"), ["a", " ", "1"]);
        // The combining acute accent is a mark: a letter for Qwen3.5, not for Qwen2.
        assert_eq!(words(PreTokenizer::Qwen35, "e\u{301}x"), ["e\u{301}x"]);
        assert_eq!(words(PreTokenizer::Qwen2, "e\u{301}x"), ["e", "\u{301}x"]);
    }

    #[test]
    fn newline_runs_for_sentencepiece_style_bpe() {
        let mut out = Vec::new();
        let text = "a b\n\nc\n";
        split_newline_runs(text, &mut |a, b| {
            out.push(String::from(&text[a..b]));
            Ok(())
        })
        .unwrap();
        assert_eq!(out, ["a b", "\n\n", "c", "\n"]);
    }

    /// GPT-4o: a letter run ends where an upper-case run follows lower case (non-ASCII letters count
    /// as either case), contractions stay with their word, `/` closes a punctuation run.
    #[test]
    fn gpt4o_letter_case_runs() {
        let w = |s| words(PreTokenizer::Gpt4o, s);
        assert_eq!(w("HTTPServerError"), ["HTTPServer", "Error"]);
        assert_eq!(w("HELLO world"), ["HELLO", " world"]);
        assert_eq!(w(" it'S they'RE"), [" it'S", " they'RE"]);
        assert_eq!(w("'s"), ["'s"]);
        assert_eq!(w("ÄB"), ["Ä", "B"]);
        // U*L+ first: its L+ can only take the É, so the rest is the U+ alternative's.
        assert_eq!(w("ÉCOLE straße"), ["É", "COLE", " straße"]);
        assert_eq!(w("12345"), ["123", "45"]);
        assert_eq!(w("a+/\nb"), ["a", "+/\n", "b"]);
        assert_eq!(w("x  \n\n y"), ["x", "  \n\n", " y"]);
    }

    #[test]
    fn default_stages() {
        let w = |s| words(PreTokenizer::Default, s);
        assert_eq!(w("12345"), ["123", "45"]);
        assert_eq!(w("a+b"), ["a", "+", "b"]);
        assert_eq!(w("x `y`"), ["x", " `", "y", "`"]);
        assert_eq!(w("hello, world"), ["hello", ",", " world"]);
    }

    #[test]
    fn empty_and_long_inputs_are_linear() {
        assert!(words(PreTokenizer::Llama3, "").is_empty());
        let long: String = core::iter::repeat_n(' ', 100_000).collect::<String>() + "x";
        assert_eq!(words(PreTokenizer::Gpt2, &long).len(), 2);
        assert_eq!(words(PreTokenizer::Llama3, &long).len(), 2);
    }
}
