//! An indexed binary min-heap over symbol positions, in caller memory.
//!
//! Each symbol has at most one pending merge (with its right neighbour), so the heap holds symbol
//! indices and `pos[i]` says where symbol `i` sits in it. The key of symbol `i` is
//! `(prio[i], i)`: lower priority value first, then the leftmost symbol, which is the order
//! llama.cpp's merge queues pop in. Keys can be changed and entries removed in O(log n), so stale
//! entries never pile up the way they do in a lazy priority queue.

/// No position / not in the heap.
pub(crate) const NONE: u32 = u32::MAX;

pub(crate) struct Heap<'s> {
    heap: &'s mut [u32],
    pos: &'s mut [u32],
    prio: &'s mut [u32],
    len: usize,
}

impl<'s> Heap<'s> {
    /// A heap for symbols `0..n`, over three slices of at least `n` words each.
    pub(crate) fn new(heap: &'s mut [u32], pos: &'s mut [u32], prio: &'s mut [u32]) -> Self {
        pos.fill(NONE);
        Heap { heap, pos, prio, len: 0 }
    }

    #[inline]
    fn key(&self, i: u32) -> u64 {
        (u64::from(self.prio[i as usize]) << 32) | u64::from(i)
    }

    #[inline]
    fn place(&mut self, slot: usize, i: u32) {
        self.heap[slot] = i;
        self.pos[i as usize] = slot as u32;
    }

    fn sift_up(&mut self, mut slot: usize) {
        let i = self.heap[slot];
        let k = self.key(i);
        while slot > 0 {
            let parent = (slot - 1) / 2;
            let p = self.heap[parent];
            if self.key(p) <= k {
                break;
            }
            self.place(slot, p);
            slot = parent;
        }
        self.place(slot, i);
    }

    fn sift_down(&mut self, mut slot: usize) {
        let i = self.heap[slot];
        let k = self.key(i);
        loop {
            let left = 2 * slot + 1;
            if left >= self.len {
                break;
            }
            let right = left + 1;
            let mut child = left;
            if right < self.len && self.key(self.heap[right]) < self.key(self.heap[left]) {
                child = right;
            }
            let c = self.heap[child];
            if self.key(c) >= k {
                break;
            }
            self.place(slot, c);
            slot = child;
        }
        self.place(slot, i);
    }

    /// Sets symbol `i`'s priority and puts it in the heap (or moves it if already there).
    pub(crate) fn set(&mut self, i: u32, prio: u32) {
        let old = self.prio[i as usize];
        self.prio[i as usize] = prio;
        let slot = self.pos[i as usize];
        if slot == NONE {
            let slot = self.len;
            self.len += 1;
            self.place(slot, i);
            self.sift_up(slot);
        } else if prio < old {
            self.sift_up(slot as usize);
        } else {
            self.sift_down(slot as usize);
        }
    }

    /// Takes symbol `i` out of the heap if it is there.
    pub(crate) fn remove(&mut self, i: u32) {
        let slot = self.pos[i as usize];
        if slot == NONE {
            return;
        }
        self.pos[i as usize] = NONE;
        self.len -= 1;
        let slot = slot as usize;
        if slot == self.len {
            return;
        }
        let last = self.heap[self.len];
        self.place(slot, last);
        self.sift_down(slot);
        self.sift_up(self.pos[last as usize] as usize);
    }

    /// Takes out the symbol with the smallest key.
    pub(crate) fn pop(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let top = self.heap[0];
        self.remove(top);
        Some(top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_key_order_with_updates_and_removals() {
        let (mut h, mut p, mut r) = ([0u32; 64], [0u32; 64], [0u32; 64]);
        let mut heap = Heap::new(&mut h, &mut p, &mut r);
        // Deterministic pseudo-random priorities with many ties.
        let mut x = 12345u32;
        let mut want = [0u32; 64];
        for i in 0..64u32 {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            want[i as usize] = (x >> 16) % 7;
            heap.set(i, want[i as usize]);
        }
        for i in (0..64u32).step_by(5) {
            want[i as usize] = (i * 3) % 5;
            heap.set(i, want[i as usize]);
        }
        for i in (0..64u32).step_by(7) {
            heap.remove(i);
            want[i as usize] = u32::MAX;
        }
        let mut last = 0u64;
        let mut n = 0;
        while let Some(i) = heap.pop() {
            let k = (u64::from(want[i as usize]) << 32) | u64::from(i);
            assert!(want[i as usize] != u32::MAX, "removed symbol {i} came back");
            assert!(k >= last, "out of order");
            last = k;
            n += 1;
        }
        assert_eq!(n, 64 - 10);
    }
}
