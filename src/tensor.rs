//! Tensor descriptors: element type, shape, byte strides, where the data lives, and how it is made.
//!
//! Shapes follow ggml: `ne[0]` is the innermost (contiguous) dimension, `nb[i]` the byte stride of
//! dimension `i`. A tensor never owns memory; its data is in a model buffer, in the arena (a
//! planned activation slot or a persistent region such as the KV cache), or is a view of another
//! tensor's data.

use crate::op::{Op, OpParams};
use crate::quant::GgmlType;

/// Most sources an op reads (flash attention: queries, keys, values, token positions).
pub const MAX_SRC: usize = 8;

/// Index of a tensor in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TensorId(pub u16);

impl TensorId {
    /// The index as usize.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Where a tensor's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// In caller-provided buffer `buffer` (model mmap, repacked weights, inputs) at `offset`.
    External {
        /// Index into the buffer table given to the executor.
        buffer: u8,
        /// Byte offset in that buffer.
        offset: usize,
    },
    /// In the arena's persistent region (KV cache), at `offset` from the arena start.
    Persistent {
        /// Byte offset in the arena.
        offset: usize,
    },
    /// A planned activation: the planner assigns its offset.
    Activation,
    /// Shares the bytes of `base` starting `offset` bytes in.
    View {
        /// The viewed tensor.
        base: TensorId,
        /// Byte offset from the start of `base`'s data.
        offset: usize,
    },
}

/// One node of a computation graph (a leaf when its op is [`Op::None`]).
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Element type.
    pub ty: GgmlType,
    /// Elements per dimension (innermost first). Upper bounds for dims in `dyn_kv`.
    pub ne: [usize; 4],
    /// Byte stride per dimension.
    pub nb: [usize; 4],
    /// Bit `d` set: dimension `d` equals the KV length of the step being run (at most `ne[d]`).
    pub dyn_kv: u8,
    /// Where the data lives.
    pub storage: Storage,
    /// The operation that computes this tensor.
    pub op: Op,
    /// Operation parameters.
    pub params: OpParams,
    /// Sources, in op-specific order.
    pub src: [Option<TensorId>; MAX_SRC],
    /// Label for errors and reports (`"blk.3.ffn_out"`), truncated to fit.
    pub name: heapless::String<40>,
}

/// Byte strides of a contiguous tensor of type `ty` and shape `ne`, or `None` when the row length
/// is not a whole number of blocks or the size overflows.
pub fn contiguous_strides(ty: GgmlType, ne: [usize; 4]) -> Option<[usize; 4]> {
    let row = ty.bytes_for(ne[0] as u64)?;
    let row = usize::try_from(row).ok()?;
    let nb1 = row;
    let nb2 = nb1.checked_mul(ne[1])?;
    let nb3 = nb2.checked_mul(ne[2])?;
    nb3.checked_mul(ne[3])?;
    Some([ty.block_bytes(), nb1, nb2, nb3])
}

impl Tensor {
    /// Total elements.
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Rows (all dimensions but the first).
    pub fn n_rows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes spanned by the data, from the first to one past the last byte (strided and
    /// transposed views included: the last element of every dimension is counted with its stride).
    pub fn span_bytes(&self) -> usize {
        if self.ne.contains(&0) {
            return 0;
        }
        let blocks = self.ne[0] / self.ty.block_len();
        let last = (blocks.saturating_sub(1)) * self.nb[0]
            + (1..4).map(|d| (self.ne[d] - 1) * self.nb[d]).sum::<usize>();
        last + self.ty.block_bytes()
    }

    /// Whether rows are packed without gaps in dimension order.
    pub fn is_contiguous(&self) -> bool {
        contiguous_strides(self.ty, self.ne).is_some_and(|nb| nb == self.nb)
    }

    /// Whether each row's elements are packed (`nb[0]` is the element or block size).
    pub fn rows_are_contiguous(&self) -> bool {
        self.nb[0] == self.ty.block_bytes()
    }

    /// Byte offset of row `(i1, i2, i3)` from the tensor's start.
    pub fn row_offset(&self, i1: usize, i2: usize, i3: usize) -> usize {
        i1 * self.nb[1] + i2 * self.nb[2] + i3 * self.nb[3]
    }

    /// The shape with dims in `dyn_kv` set to `n_kv` (clamped to their upper bound).
    pub fn ne_for(&self, n_kv: usize) -> [usize; 4] {
        let mut ne = self.ne;
        for (d, n) in ne.iter_mut().enumerate() {
            if self.dyn_kv & (1 << d) != 0 {
                *n = n_kv.min(*n);
            }
        }
        ne
    }
}
