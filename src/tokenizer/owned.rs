//! std: a tokenizer that owns its tables, the one way every std front end builds one (the CLI's
//! commands, the server, the C ABI). The tables are freed with it. Bare metal gives
//! [`Tokenizer::new`] storage carved from its arena itself.

use core::ops::Deref;
use std::vec::Vec;

use super::{TokError, Tokenizer};
use crate::gguf::Gguf;

/// A [`Tokenizer`] over tables in a heap buffer it owns; use it as a `&Tokenizer`.
pub struct OwnedTokenizer {
    /// Borrows `storage`'s heap buffer, not `'static` data: only ever handed out behind `&self`.
    /// Declared first, so it is dropped before the buffer.
    tokenizer: Tokenizer<'static>,
    /// The tables, [`Tokenizer::storage_words`] words. Never touched after the build: a `Vec`
    /// (unlike a `Box`) may move with the struct while `tokenizer` points into its buffer.
    _storage: Vec<u32>,
}

impl OwnedTokenizer {
    /// Builds the tokenizer of `g`'s vocabulary in a buffer of the size it needs.
    pub fn new(g: &Gguf<'_>) -> Result<Self, TokError> {
        // As many words as the file's token texts and counts say, so at most a few times its size.
        let mut storage = std::vec![0u32; Tokenizer::storage_words(g)?];
        // SAFETY: the buffer lives as long as `self` (it is freed only when `self` drops, after
        // `tokenizer`), is never accessed through `storage` again, and does not move when the
        // `Vec` moves. The `'static` borrow never leaves `self` longer than `&self`: `Deref` hands
        // it out as `&'s Tokenizer<'static>` whose methods return nothing tied to the tables'
        // lifetime (they are all in `impl Tokenizer<'_>`).
        let tables: &'static mut [u32] = unsafe { &mut *(storage.as_mut_slice() as *mut [u32]) };
        let tokenizer = Tokenizer::new(g, tables)?;
        Ok(Self { tokenizer, _storage: storage })
    }
}

impl Deref for OwnedTokenizer {
    type Target = Tokenizer<'static>;

    fn deref(&self) -> &Tokenizer<'static> {
        &self.tokenizer
    }
}

impl core::fmt::Debug for OwnedTokenizer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.tokenizer.fmt(f)
    }
}
