//! Where an M-RoPE model's tokens sit (Qwen2-VL): a text token's every axis takes one position,
//! an image's tokens share the image's first time position and take row and column positions
//! from its grid, and the text after an image goes on from that time plus the image's longer
//! side, as libmtmd places them (`mtmd_image_tokens_get_decoder_pos`, `_get_n_pos`). The cache
//! rows stay in order and the attention stays causal by row: the raster order of the image's
//! tokens is llama.cpp's 2-D causal mask.

/// Images one sequence of an M-RoPE model holds at most.
pub const MAX_IMAGES: usize = 16;

/// An image's tokens in a sequence: cache rows `start..start + n` (`n` at most `nx * ny`, fewer
/// once cut), in raster order over a grid of `nx` columns and `ny` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    /// First cache row.
    pub start: usize,
    /// Rows held.
    pub n: usize,
    /// Columns of the grid.
    pub nx: usize,
    /// Rows of the grid.
    pub ny: usize,
}

impl ImageSpan {
    /// Time positions the image takes in the text: its longer side.
    fn n_pos(&self) -> usize {
        self.nx.max(self.ny)
    }
}

/// The images of one sequence, in order of their rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageSpans(heapless::Vec<ImageSpan, MAX_IMAGES>);

impl ImageSpans {
    /// Whether the sequence holds no image.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an image starts in the first `n` rows.
    pub fn starts_before(&self, n: usize) -> bool {
        self.0.first().is_some_and(|s| s.start < n)
    }

    /// Places an image of `nx` x `ny` tokens at row `start` (the sequence's next), forgetting
    /// any image at or after it; `false` when the sequence holds [`MAX_IMAGES`] already.
    pub fn place(&mut self, start: usize, nx: usize, ny: usize) -> bool {
        self.cut(start);
        self.0.push(ImageSpan { start, n: nx * ny, nx, ny }).is_ok()
    }

    /// Forgets rows `n..`: images from there on, and the tail of one they cut.
    pub fn cut(&mut self, n: usize) {
        self.0.retain(|s| s.start < n);
        if let Some(last) = self.0.last_mut() {
            last.n = last.n.min(n - last.start);
        }
    }

    /// The (time, row, column) positions of cache row `row`.
    pub fn positions(&self, row: usize) -> [usize; 3] {
        let mut shift: isize = 0;
        for s in &self.0 {
            if row < s.start {
                break;
            }
            if row < s.start + s.n {
                let base = s.start.saturating_add_signed(shift);
                let i = row - s.start;
                return [base, base + i / s.nx, base + i % s.nx];
            }
            shift += s.n_pos() as isize - s.n as isize;
        }
        let p = row.saturating_add_signed(shift);
        [p, p, p]
    }

    /// The time position of the row after the first `n`: where the sequence's text goes on.
    pub fn next_position(&self, n: usize) -> usize {
        let mut shift: isize = 0;
        for s in self.0.iter().filter(|s| s.start < n) {
            shift += s.n_pos() as isize - s.n.min(n - s.start) as isize;
        }
        n.saturating_add_signed(shift)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_after_an_image_goes_on_from_its_time_plus_its_longer_side() {
        // libmtmd's layout of tests/golden/vision/qwen2vl/baseline_200x120.json: 4 text tokens,
        // a 7 x 4 image at position 4, the text after it from position 11.
        let mut spans = ImageSpans::default();
        assert_eq!(spans.positions(3), [3, 3, 3]);
        assert!(spans.place(4, 7, 4));
        assert_eq!(spans.positions(4), [4, 4, 4]);
        assert_eq!(spans.positions(4 + 6), [4, 4, 10]);
        assert_eq!(spans.positions(4 + 7), [4, 5, 4]);
        assert_eq!(spans.positions(4 + 27), [4, 7, 10]);
        assert_eq!(spans.positions(32), [11, 11, 11]);
        assert_eq!(spans.next_position(32), 11);
        assert_eq!(spans.next_position(4), 4);
        // A tall image: its rows are its longer side.
        assert!(spans.place(40, 2, 5));
        assert_eq!(spans.positions(50), [11 + 8 + 5, 11 + 8 + 5, 11 + 8 + 5]);
        assert_eq!(spans.positions(41), [19, 19, 20]);
    }

    #[test]
    fn cutting_forgets_later_images_and_shortens_the_one_cut() {
        let mut spans = ImageSpans::default();
        assert!(spans.place(1, 3, 3));
        assert!(spans.place(20, 2, 2));
        spans.cut(5);
        assert_eq!(spans.0.len(), 1);
        assert_eq!(spans.0[0].n, 4);
        // The cut image still takes its longer side; its rows kept are 1..5.
        assert_eq!(spans.next_position(5), 1 + 3);
        assert_eq!(spans.positions(4), [1, 2, 1]);
        spans.cut(1);
        assert!(spans.is_empty());
        assert_eq!(spans.positions(7), [7, 7, 7]);
        // Placing again at an image's row replaces it and what follows.
        assert!(spans.place(2, 1, 1));
        assert!(spans.place(2, 4, 1));
        assert_eq!(spans.0.len(), 1);
        assert_eq!(spans.next_position(6), 2 + 4);
        // A 1 x 1 image takes one position, as a token does.
        let mut one = ImageSpans::default();
        assert!(one.place(0, 1, 1));
        assert_eq!(one.next_position(1), 1);
        for _ in 0..MAX_IMAGES - 1 {
            let n = one.0.last().map_or(0, |s| s.start + s.n);
            assert!(one.place(n, 1, 1));
        }
        assert!(!one.place(100, 1, 1), "more than MAX_IMAGES accepted");
    }
}
