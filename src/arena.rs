//! A fixed arena over caller-provided memory.
//!
//! The caller hands over one block of bytes (a `static` buffer on bare metal, an mmap or heap
//! block on std). The arena aligns its start to 64 bytes and hands out regions: persistent ones
//! (KV cache) bump-allocated from the front, then one activation region sized by the planner and
//! one work region for kernels' scratch. Nothing is ever freed or grown; running out is an error
//! that says how many bytes were needed.

use core::fmt;

/// Alignment of the arena start and of every region.
pub const ARENA_ALIGN: usize = 64;

/// A region of the arena: byte offset and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Region {
    /// Offset from the (aligned) arena start.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The arena ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaExhausted {
    /// What was being allocated.
    pub what: &'static str,
    /// Bytes the arena would need in total to satisfy the request.
    pub needed: usize,
    /// Bytes the arena has.
    pub capacity: usize,
}

impl fmt::Display for ArenaExhausted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "arena exhausted allocating {}: needs {} bytes, has {} (give it at least {} bytes)",
            self.what, self.needed, self.capacity, self.needed
        )
    }
}

impl core::error::Error for ArenaExhausted {}

/// Bump allocator over `&'a mut [u8]`.
pub struct Arena<'a> {
    mem: &'a mut [u8],
    used: usize,
}

fn align_up(n: usize) -> Option<usize> {
    Some(n.checked_add(ARENA_ALIGN - 1)? & !(ARENA_ALIGN - 1))
}

impl<'a> Arena<'a> {
    /// An arena over `mem`; the first bytes are skipped so that the start is 64-byte aligned.
    pub fn new(mem: &'a mut [u8]) -> Self {
        let skip = mem.as_ptr().align_offset(ARENA_ALIGN).min(mem.len());
        let (_, aligned) = mem.split_at_mut(skip);
        Self { mem: aligned, used: 0 }
    }

    /// Bytes a caller must provide for `needed` usable bytes, whatever the block's alignment.
    pub fn bytes_for(needed: usize) -> usize {
        needed.saturating_add(ARENA_ALIGN)
    }

    /// Usable bytes.
    pub fn capacity(&self) -> usize {
        self.mem.len()
    }

    /// Bytes handed out so far.
    pub fn used(&self) -> usize {
        self.used
    }

    /// A new region of `len` bytes, 64-byte aligned, zero-filled.
    pub fn alloc(&mut self, len: usize, what: &'static str) -> Result<Region, ArenaExhausted> {
        let region = self.alloc_unzeroed(len, what)?;
        self.bytes_mut(region).fill(0);
        Ok(region)
    }

    /// A new region of `len` bytes, 64-byte aligned, holding whatever the caller's memory held:
    /// for regions whose every byte is written before it is read. Untouched pages of fresh
    /// memory (an mmap, `calloc`) then stay untouched until used.
    pub fn alloc_unzeroed(&mut self, len: usize, what: &'static str) -> Result<Region, ArenaExhausted> {
        let exhausted = ArenaExhausted { what, needed: usize::MAX, capacity: self.mem.len() };
        let offset = align_up(self.used).ok_or(exhausted)?;
        let end = offset.checked_add(len).ok_or(exhausted)?;
        if end > self.mem.len() {
            return Err(ArenaExhausted { needed: end, ..exhausted });
        }
        self.used = end;
        Ok(Region { offset, len })
    }

    /// The bytes of `region`.
    pub fn bytes(&self, region: Region) -> &[u8] {
        &self.mem[region.offset..region.offset + region.len]
    }

    /// The bytes of `region`, mutable.
    pub fn bytes_mut(&mut self, region: Region) -> &mut [u8] {
        &mut self.mem[region.offset..region.offset + region.len]
    }

    /// All arena bytes (the executor addresses tensors by offset from here).
    pub fn memory(&mut self) -> &mut [u8] {
        self.mem
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_exhaustion_says_how_much() {
        let mut block = [0u8; 1000];
        let mut arena = Arena::new(&mut block[3..]);
        assert_eq!(arena.memory().as_ptr() as usize % ARENA_ALIGN, 0);
        let a = arena.alloc(10, "kv cache").unwrap();
        let b = arena.alloc(100, "activations").unwrap();
        assert_eq!((a.offset, b.offset), (0, 64));
        arena.bytes_mut(b).fill(7);
        assert!(arena.bytes(a).iter().all(|&x| x == 0));
        let err = arena.alloc(10_000, "work").unwrap_err();
        assert_eq!((err.what, err.needed), ("work", 192 + 10_000));
        assert!(err.message().contains("needs 10192 bytes"));
    }

    impl ArenaExhausted {
        fn message(self) -> heapless::String<200> {
            let mut s = heapless::String::new();
            let _ = core::fmt::write(&mut s, format_args!("{self}"));
            s
        }
    }
}
