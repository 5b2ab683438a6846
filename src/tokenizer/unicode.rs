//! What the pre-tokenizers need to know about a code point (its class and whether it is white space),
//! BERT's accent stripping and lower-casing of it, UTF-8 stepping over `&str` bytes, GPT-2's
//! byte-level mapping between bytes and characters, and SentencePiece's escaped space.

use super::unicode_tables::{
    LOWER_DELTA, LOWER_RUNS, N_RANGES, RANGE_CLASS, RANGE_START, STRIP_ASTRAL_FROM, STRIP_ASTRAL_TO,
    STRIP_BMP_FROM, STRIP_BMP_TO, STRIP_MULTI_FROM, STRIP_MULTI_TO, WHITESPACE,
};

/// U+2581 in UTF-8, SentencePiece's escaped space.
pub(crate) const SPACE: [u8; 3] = [0xE2, 0x96, 0x81];

/// A code point's class as llama.cpp's `unicode_cpt_flags` sees it, plus white space, packed in a
/// byte. [`Flags::OUT`] (all zero) stands for "outside the text being split", like llama.cpp's
/// default-constructed flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flags(u8);

impl Flags {
    const NUMBER: u8 = 1;
    const LETTER: u8 = 2;
    const MARK: u8 = 4;
    const PUNCTUATION: u8 = 8;
    const WHITESPACE: u8 = 16;
    /// Set for every code point inside the text (whatever its class).
    const IN: u8 = 32;
    /// Nonspacing marks (Mn), a part of [`Flags::MARK`]: what BERT's accent stripping drops.
    const NONSPACING: u8 = 64;
    /// Control, format, surrogate and private use characters (Cc Cf Cs Co; not unassigned ones):
    /// what BERT's normalizer drops.
    const CONTROL: u8 = 128;

    /// No code point: a position past either end of the piece of text being split.
    pub(crate) const OUT: Flags = Flags(0);

    const fn from_class(class: u8, whitespace: bool) -> Flags {
        let bits = match class {
            1 => Self::NUMBER,
            2 => Self::LETTER,
            4 => Self::MARK,
            5 => Self::PUNCTUATION,
            7 => Self::CONTROL,
            8 => Self::MARK | Self::NONSPACING,
            _ => 0,
        };
        Flags(bits | Self::IN | if whitespace { Self::WHITESPACE } else { 0 })
    }

    /// `\p{N}`.
    #[inline]
    pub(crate) fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }

    /// `\p{L}`.
    #[inline]
    pub(crate) fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }

    /// `\p{M}`.
    #[inline]
    pub(crate) fn is_mark(self) -> bool {
        self.0 & Self::MARK != 0
    }

    /// `\p{P}`.
    #[inline]
    pub(crate) fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }

    /// General category Mn.
    #[inline]
    pub(crate) fn is_nonspacing_mark(self) -> bool {
        self.0 & Self::NONSPACING != 0
    }

    /// General category Cc, Cf, Cs or Co (not Cn).
    #[inline]
    pub(crate) fn is_control(self) -> bool {
        self.0 & Self::CONTROL != 0
    }

    /// `\s` (the White_Space property).
    #[inline]
    pub(crate) fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }

    /// Whether this is a code point of the text (not [`Flags::OUT`]).
    #[inline]
    pub(crate) fn is_in(self) -> bool {
        self.0 != 0
    }
}

/// Class number (as in the generated table) of `cp` by binary search of the range starts.
const fn class_by_search(cp: u32) -> u8 {
    // Largest i with RANGE_START[i] <= cp; RANGE_START[0] == 0.
    let (mut lo, mut hi) = (0usize, N_RANGES);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if RANGE_START[mid] <= cp {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    RANGE_CLASS[lo]
}

const fn is_whitespace_cp(cp: u32) -> bool {
    let mut i = 0;
    while i < WHITESPACE.len() {
        if WHITESPACE[i] == cp {
            return true;
        }
        i += 1;
    }
    false
}

/// Direct table for the first 2048 code points (Latin, Greek, Cyrillic, Hebrew, Arabic...).
const LOW: usize = 0x800;
static LOW_FLAGS: [Flags; LOW] = {
    let mut t = [Flags::OUT; LOW];
    let mut cp = 0;
    while cp < LOW {
        t[cp] = Flags::from_class(class_by_search(cp as u32), is_whitespace_cp(cp as u32));
        cp += 1;
    }
    t
};

/// The flags of code point `cp` (any `u32`; beyond U+10FFFF is "undefined", as in llama.cpp).
#[inline]
pub(crate) fn flags(cp: u32) -> Flags {
    if (cp as usize) < LOW {
        return LOW_FLAGS[cp as usize];
    }
    if cp > 0x10FFFF {
        return Flags(Flags::IN);
    }
    let ws = matches!(cp, 0x1680 | 0x2000..=0x200A | 0x2028 | 0x2029 | 0x202F | 0x205F | 0x3000);
    Flags::from_class(class_by_search(cp), ws)
}

/// What a code point becomes under one of BERT's mappings: none to three code points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mapped {
    cps: [u32; 3],
    len: u8,
}

impl Mapped {
    /// The code point itself.
    pub(crate) fn one(cp: u32) -> Self {
        Mapped { cps: [cp, 0, 0], len: 1 }
    }

    pub(crate) fn as_slice(&self) -> &[u32] {
        &self.cps[..self.len as usize]
    }
}

const HANGUL_FIRST: u32 = 0xAC00;
const HANGUL_LAST: u32 = 0xD7A3;

/// BERT's `strip_accents` of one code point: its canonical decomposition (NFD, as HF tokenizers
/// computes it) without nonspacing marks; nothing for a nonspacing mark.
pub(crate) fn strip_accents(cp: u32) -> Mapped {
    let one = Mapped::one;
    if flags(cp).is_nonspacing_mark() {
        return Mapped { cps: [0; 3], len: 0 };
    }
    if (HANGUL_FIRST..=HANGUL_LAST).contains(&cp) {
        // Unicode's arithmetic decomposition into leading consonant, vowel and optional trailing one.
        let s = cp - HANGUL_FIRST;
        let (l, v, t) = (0x1100 + s / 588, 0x1161 + (s % 588) / 28, s % 28);
        return Mapped { cps: [l, v, 0x11A7 + t], len: if t == 0 { 2 } else { 3 } };
    }
    if cp <= 0xFFFF {
        if let Ok(i) = STRIP_BMP_FROM.binary_search(&(cp as u16)) {
            return one(u32::from(STRIP_BMP_TO[i]));
        }
    } else if let Ok(i) = STRIP_ASTRAL_FROM.binary_search(&cp) {
        return one(STRIP_ASTRAL_TO[i]);
    }
    match STRIP_MULTI_FROM.binary_search(&cp) {
        Ok(i) => {
            let cps = STRIP_MULTI_TO[i];
            Mapped { cps, len: cps.iter().take_while(|&&c| c != 0).count() as u8 }
        }
        Err(_) => one(cp),
    }
}

/// The simple lowercase mapping of `cp` (itself when it has none). U+0130, the one code point
/// whose full mapping is longer, maps to 'i' here: see [`lowercase_full`].
pub(crate) fn lowercase(cp: u32) -> u32 {
    if cp < 0x80 {
        return (cp as u8).to_ascii_lowercase() as u32;
    }
    // The last run starting at or before cp.
    let i = LOWER_RUNS.partition_point(|&r| r >> 11 <= cp);
    let Some(&run) = i.checked_sub(1).and_then(|i| LOWER_RUNS.get(i)) else { return cp };
    let (start, count, spacing) = (run >> 11, (run >> 1) & 0x3FF, (run & 1) + 1);
    let k = cp - start;
    if k < count * spacing && k % spacing == 0 {
        cp.wrapping_add_signed(LOWER_DELTA[i - 1])
    } else {
        cp
    }
}

/// The full lowercase mapping (as Rust's `char::to_lowercase`, which HF tokenizers uses): the simple
/// one but for U+0130, which becomes "i" and U+0307.
pub(crate) fn lowercase_full(cp: u32) -> Mapped {
    if cp == 0x130 {
        return Mapped { cps: ['i' as u32, 0x307, 0], len: 2 };
    }
    Mapped::one(lowercase(cp))
}

/// The character starting at byte `i` of `s` (valid UTF-8, `i` on a boundary) and its length.
#[inline]
pub(crate) fn char_at(s: &[u8], i: usize) -> (u32, usize) {
    let b0 = s[i] as u32;
    if b0 < 0x80 {
        return (b0, 1);
    }
    let cont = |k: usize| (s.get(i + k).copied().unwrap_or(0x80) & 0x3F) as u32;
    if b0 < 0xE0 {
        (((b0 & 0x1F) << 6) | cont(1), 2)
    } else if b0 < 0xF0 {
        (((b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        (((b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4)
    }
}

/// Length of the UTF-8 sequence a lead byte starts (llama.cpp's `unicode_len_utf8`).
#[inline]
pub(crate) fn utf8_len(lead: u8) -> usize {
    match lead >> 4 {
        0xC | 0xD => 2,
        0xE => 3,
        0xF => 4,
        _ => 1,
    }
}

/// C's `isspace` in the "C" locale, which llama.cpp uses to strip text next to special tokens.
#[inline]
pub(crate) fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// Whether byte `b` stands for itself in GPT-2's byte-to-unicode mapping ('!'..='~', '¡'..='¬',
/// '®'..='ÿ'); the other 68 bytes are moved to U+0100.. in increasing order.
const fn byte_is_printable(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// GPT-2's byte-to-unicode mapping: the code point that stands for byte `b` in vocabulary text.
pub(crate) static BYTE_TO_CHAR: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut n = 0u16;
    let mut b = 0;
    while b < 256 {
        if byte_is_printable(b as u8) {
            t[b] = b as u16;
        } else {
            t[b] = 256 + n;
            n += 1;
        }
        b += 1;
    }
    t
};

/// The UTF-8 bytes of `BYTE_TO_CHAR[b]` (1 or 2 bytes) and their count.
pub(crate) static BYTE_TO_UTF8: [([u8; 2], u8); 256] = {
    let mut t = [([0u8; 2], 0u8); 256];
    let mut b = 0;
    while b < 256 {
        let cp = BYTE_TO_CHAR[b] as u32;
        t[b] = if cp < 0x80 {
            ([cp as u8, 0], 1)
        } else {
            ([0xC0 | (cp >> 6) as u8, 0x80 | (cp & 0x3F) as u8], 2)
        };
        b += 1;
    }
    t
};

/// `char_to_byte` for U+0100..=U+0143 as a table.
static HIGH_TO_BYTE: [u8; 68] = {
    let mut t = [0u8; 68];
    let mut b = 0;
    while b < 256 {
        let cp = BYTE_TO_CHAR[b] as usize;
        if cp >= 256 {
            t[cp - 256] = b as u8;
        }
        b += 1;
    }
    t
};

/// The byte a vocabulary character stands for in GPT-2's mapping, if any.
#[inline]
pub(crate) fn char_to_byte(cp: u32) -> Option<u8> {
    match cp {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(cp as u8),
        0x100..=0x143 => Some(HIGH_TO_BYTE[(cp - 0x100) as usize]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_known_code_points() {
        assert!(flags('a' as u32).is_letter());
        assert!(flags('Z' as u32).is_letter());
        assert!(flags('7' as u32).is_number());
        assert!(flags(' ' as u32).is_whitespace());
        assert!(!flags(0x1C).is_whitespace(), "U+001C is not White_Space (Python's isspace says it is)");
        assert!(flags(0x85).is_whitespace());
        assert!(flags(0x3000).is_whitespace());
        assert!(flags(0x2003).is_whitespace());
        assert!(flags('é' as u32).is_letter());
        assert!(flags('日' as u32).is_letter());
        assert!(flags(0x0301).is_mark());
        assert!(flags('½' as u32).is_number());
        assert!(flags('٣' as u32).is_number());
        assert!(flags('!' as u32).is_punctuation());
        assert!(flags('«' as u32).is_punctuation());
        let emoji = flags(0x1F600);
        assert!(emoji.is_in() && !emoji.is_letter() && !emoji.is_number() && !emoji.is_whitespace());
        // Last range runs to the end of Unicode; beyond it is "undefined" but inside the text.
        assert!(flags(0x10FFFF).is_in());
        assert!(flags(0x110000).is_in());
        assert!(!Flags::OUT.is_in());
        // Unassigned in Unicode 15.1 but assigned in 16.0: our table says undefined, like llama.cpp's.
        assert!(!flags(0x1C89).is_letter());
        // Assigned in 15.1 (CJK Extension I).
        assert!(flags(0x2EBF0).is_letter());
        // BERT's classes: Mn apart from the other marks, category C.
        assert!(flags(0x0301).is_nonspacing_mark() && flags(0x0301).is_mark());
        assert!(flags(0x093E).is_mark() && !flags(0x093E).is_nonspacing_mark(), "Devanagari AA is Mc");
        assert!(flags(0x00).is_control() && flags(0x200B).is_control() && flags(0xE000).is_control());
        assert!(!flags(0x0378).is_control(), "unassigned");
        assert!(!flags('a' as u32).is_control() && !flags(' ' as u32).is_control());
    }

    #[test]
    fn accents_strip_and_letters_lowercase() {
        let strip = |c: char| strip_accents(c as u32).as_slice().to_vec();
        assert_eq!(strip('é'), ['e' as u32]);
        assert_eq!(strip('Å'), ['A' as u32]);
        assert_eq!(strip('\u{212B}'), ['A' as u32], "ANGSTROM SIGN");
        assert_eq!(strip('ǖ'), ['u' as u32], "two marks");
        assert!(strip('\u{0301}').is_empty(), "a lone accent");
        assert_eq!(strip('a'), ['a' as u32]);
        assert_eq!(strip('한'), [0x1112, 0x1161, 0x11AB]);
        assert_eq!(strip('하'), [0x1112, 0x1161]);
        assert_eq!(strip('\u{0DDA}'), [0x0DD9], "Sinhala: the Mn of its decomposition dropped");
        assert_eq!(strip('\u{0DDD}'), [0x0DD9, 0x0DCF]);
        assert_eq!(strip('\u{F900}'), [0x8C48], "CJK compatibility ideograph");
        assert_eq!(strip('\u{2F800}'), [0x4E3D]);
        assert_eq!(strip('ñ'), ['n' as u32]);
        let lower = |c: char| char::from_u32(lowercase(c as u32)).unwrap();
        assert_eq!(lower('A'), 'a');
        assert_eq!(lower('Z'), 'z');
        assert_eq!(lower('É'), 'é');
        assert_eq!(lower('Ā'), 'ā');
        assert_eq!(lower('ā'), 'ā');
        assert_eq!(lower('Σ'), 'σ');
        assert_eq!(lower('Ж'), 'ж');
        assert_eq!(lower('Ａ'), 'ａ');
        assert_eq!(lower('\u{10400}'), '\u{10428}', "Deseret");
        assert_eq!(lower('\u{212A}'), 'k', "KELVIN SIGN");
        assert_eq!(lower('İ'), 'i');
        assert_eq!(lowercase_full(0x130).as_slice(), ['i' as u32, 0x307]);
        assert_eq!(lower('1'), '1');
        assert_eq!(lower('日'), '日');
        // Agrees with Rust's own mapping wherever that is one code point (its Unicode may be newer:
        // only assigned code points of our table are compared).
        for c in (0..0x110000u32).filter_map(char::from_u32) {
            let mut std_lower = c.to_lowercase();
            if let (Some(l), None) = (std_lower.next(), std_lower.next()) {
                if class_by_search(c as u32) != 0 && class_by_search(l as u32) != 0 {
                    assert_eq!(lowercase(c as u32), l as u32, "U+{:04X}", c as u32);
                }
            }
        }
    }

    #[test]
    fn table_agrees_with_search_everywhere_low() {
        for cp in 0..LOW as u32 {
            assert_eq!(flags(cp), Flags::from_class(class_by_search(cp), is_whitespace_cp(cp)), "U+{cp:04X}");
        }
    }

    #[test]
    fn gpt2_byte_mapping_is_a_bijection() {
        let mut seen = [false; 0x144];
        for b in 0..=255u8 {
            let cp = BYTE_TO_CHAR[b as usize] as u32;
            assert!(!seen[cp as usize]);
            seen[cp as usize] = true;
            assert_eq!(char_to_byte(cp), Some(b));
            let (bytes, n) = BYTE_TO_UTF8[b as usize];
            let s = core::str::from_utf8(&bytes[..n as usize]).unwrap();
            assert_eq!(s.chars().next().unwrap() as u32, cp);
        }
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 0x120); // 'Ġ'
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 0x10A); // 'Ċ'
        assert_eq!(char_to_byte(0x20), None);
        assert_eq!(char_to_byte(0xAD), None);
        assert_eq!(char_to_byte(0x144), None);
    }

    #[test]
    fn utf8_stepping() {
        let s = "aé日😀".as_bytes();
        assert_eq!(char_at(s, 0), ('a' as u32, 1));
        assert_eq!(char_at(s, 1), ('é' as u32, 2));
        assert_eq!(char_at(s, 3), ('日' as u32, 3));
        assert_eq!(char_at(s, 6), (0x1F600, 4));
        assert_eq!(utf8_len(s[6]), 4);
        assert_eq!(utf8_len(b'a'), 1);
    }
}
