//! The hashing of the token and merge tables: FNV-1a with a final mix, and the keys a token
//! text can be looked up by without being built (raw, concatenated, byte-level).

use super::unicode;

/// FNV-1a over bytes, with a final mix; the low bits pick a slot, the high 32 are the tag.
#[derive(Clone, Copy)]
pub(crate) struct Hasher(u64);

impl Hasher {
    #[inline]
    pub(crate) fn new() -> Self {
        Hasher(0xcbf2_9ce4_8422_2325)
    }

    #[inline]
    pub(crate) fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }

    #[inline]
    pub(crate) fn bytes(&mut self, s: &[u8]) {
        for &b in s {
            self.byte(b);
        }
    }

    #[inline]
    pub(crate) fn finish(self) -> u64 {
        mix(self.0)
    }
}

#[inline]
fn mix(mut h: u64) -> u64 {
    h ^= h >> 32;
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^= h >> 32;
    h
}

/// A byte sequence that can be looked up in the token table without being materialized: raw
/// text, text with spaces escaped to U+2581, or bytes in GPT-2's byte-level characters.
pub(crate) trait Key {
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Calls `f` with each byte in order until it returns false; whether all returned true.
    fn all(&self, f: impl FnMut(u8) -> bool) -> bool;

    fn hash(&self) -> u64 {
        let mut h = Hasher::new();
        self.all(|b| {
            h.byte(b);
            true
        });
        h.finish()
    }

    fn equals(&self, text: &[u8]) -> bool {
        if self.len() != text.len() {
            return false;
        }
        let mut i = 0;
        self.all(|b| {
            let same = text[i] == b;
            i += 1;
            same
        })
    }
}

impl Key for &[u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.iter().all(|&b| f(b))
    }

    fn hash(&self) -> u64 {
        let mut h = Hasher::new();
        h.bytes(self);
        h.finish()
    }

    fn equals(&self, text: &[u8]) -> bool {
        *self == text
    }
}

/// Two byte strings one after the other (a merge's two halves).
pub(super) struct Concat<'k>(pub(super) &'k [u8], pub(super) &'k [u8]);

impl Key for Concat<'_> {
    fn len(&self) -> usize {
        self.0.len() + self.1.len()
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.0.iter().chain(self.1.iter()).all(|&b| f(b))
    }
}

/// Raw bytes seen as GPT-2 byte-level characters (each byte becomes a 1- or 2-byte character).
pub(crate) struct ByteLevel<'k>(pub(crate) &'k [u8]);

impl Key for ByteLevel<'_> {
    fn len(&self) -> usize {
        self.0.iter().map(|&b| unicode::BYTE_TO_UTF8[b as usize].1 as usize).sum()
    }

    fn all(&self, mut f: impl FnMut(u8) -> bool) -> bool {
        self.0.iter().all(|&b| {
            let (enc, n) = unicode::BYTE_TO_UTF8[b as usize];
            f(enc[0]) && (n == 1 || f(enc[1]))
        })
    }
}

#[inline]
pub(super) fn merge_hash(l: u32, r: u32) -> u64 {
    mix((u64::from(l) << 32 | u64::from(r)).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hash_like_their_bytes() {
        let text = "a bé".as_bytes();
        let enc = "aĠbÃ©".as_bytes();
        assert_eq!(ByteLevel(text).len(), enc.len());
        assert_eq!(ByteLevel(text).hash(), (&enc).hash());
        assert!(ByteLevel(text).equals(enc));
        assert!(!ByteLevel(text).equals("aĠbÃ¨".as_bytes()));
        assert_eq!(Concat(b"ab", b"c").hash(), (&&b"abc"[..]).hash());
        assert!(Concat(b"ab", b"c").equals(b"abc"));
    }
}
