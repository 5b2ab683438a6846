//! clip's preprocessing per layout ([`Layout`]): the sizes, the resampling and padding, the tiles,
//! then `u8 / 255` and `(x - mean) / std` per channel in f32, as libmtmd computes them.

use std::vec;
use std::vec::Vec;

use super::resample::{resize, Pad};
use super::{ImageError, Rgb8};
use crate::model::vision::{Layout, VisionParams};

/// One input of the encoder: normalised pixels, rows top to bottom, channels interleaved.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderImage {
    /// Width in pixels (a multiple of the patch size).
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `width * height * 3` values.
    pub pixels: Vec<f32>,
}

/// An image prepared for a projector: its encoder inputs in the order the text takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessed {
    /// The encoder's inputs: the tiles row by row, then the whole image (tiled layouts), or one.
    pub images: Vec<EncoderImage>,
    /// Tiles per row and per column (tiled layouts; else 1 x 1 and no overview).
    pub grid: (u32, u32),
    /// Whether the last image is the whole image beside the tiles.
    pub overview: bool,
}

fn normalized(img: &Rgb8, vp: &VisionParams) -> EncoderImage {
    let mut pixels = Vec::with_capacity(img.pixels.len());
    for px in img.pixels.chunks_exact(3) {
        for ((&v, mean), std) in px.iter().zip(vp.mean).zip(vp.std) {
            pixels.push((f32::from(v) / 255.0 - mean) / std);
        }
    }
    EncoderImage { width: img.width, height: img.height, pixels }
}

/// `refined` (a `grid` of `tile`-pixel squares) cut into its tiles row by row, each normalized,
/// with room for one image more (the overview).
fn tiles(refined: &Rgb8, grid: (u32, u32), tile: u32, vp: &VisionParams) -> Vec<EncoderImage> {
    let (gx, gy) = grid;
    let mut images = Vec::with_capacity((gx * gy + 1) as usize);
    let t = tile as usize;
    for ty in 0..gy as usize {
        for tx in 0..gx as usize {
            let mut crop = Rgb8::filled(tile, tile, [0, 0, 0]);
            for y in 0..t {
                let src = ((ty * t + y) * refined.width as usize + tx * t) * 3;
                crop.pixels[y * t * 3..][..t * 3].copy_from_slice(&refined.pixels[src..][..t * 3]);
            }
            images.push(normalized(&crop, vp));
        }
    }
    images
}

/// The `(width, height)` clip resizes a dynamic-layout image to: each side rounded to a multiple
/// of `align` (at least one), then scaled down or up (aspect kept, floor / ceil to `align`) when
/// the pixels are over `max_pixels` or under `min_pixels` (0: no bound). f32 as clip computes it.
pub fn dynamic_size(width: u32, height: u32, align: u32, min_pixels: u64, max_pixels: u64) -> (u32, u32) {
    let f = align as f32;
    let round_to = |x: f32| (x / f).round() as i64 * i64::from(align);
    let ceil_to = |x: f32| (x / f).ceil() as i64 * i64::from(align);
    let floor_to = |x: f32| (x / f).floor() as i64 * i64::from(align);
    let (w, h) = (width as f32, height as f32);
    let a = i64::from(align);
    let mut wb = a.max(round_to(w));
    let mut hb = a.max(round_to(h));
    if max_pixels > 0 && (wb * hb) as u64 > max_pixels {
        let beta = (h * w / max_pixels as f32).sqrt();
        hb = a.max(floor_to(h / beta));
        wb = a.max(floor_to(w / beta));
    } else if min_pixels > 0 && ((wb * hb) as u64) < min_pixels {
        let beta = (min_pixels as f32 / (h * w)).sqrt();
        hb = ceil_to(h * beta);
        wb = ceil_to(w * beta);
    }
    (wb.clamp(a, i64::from(u32::MAX)) as u32, hb.clamp(a, i64::from(u32::MAX)) as u32)
}

/// The encoder inputs of `img` for the projector `vp`.
pub fn preprocess(img: &Rgb8, vp: &VisionParams) -> Result<Preprocessed, ImageError> {
    let traits = vp.traits();
    let filter = traits.resample;
    let one = |image: EncoderImage| Preprocessed { images: vec![image], grid: (1, 1), overview: false };
    match traits.layout {
        Layout::Fixed => {
            let s = vp.image_size;
            Ok(one(normalized(&resize(img, s, s, filter, Pad::Ceil), vp)))
        }
        Layout::Dynamic => {
            let align = vp.patch_size * vp.n_merge;
            let (w, h) = dynamic_size(img.width, img.height, align, vp.min_pixels, vp.max_pixels);
            Ok(one(normalized(&resize(img, w, h, filter, Pad::Ceil), vp)))
        }
        Layout::Tiles => {
            if vp.longest_edge == 0 {
                return Err(ImageError::Unsupported(
                    "this SmolVLM projector has no clip.vision.preproc_image_size (an old conversion): \
                     convert it again with a current convert_hf_to_gguf.py"
                        .into(),
                ));
            }
            let (tile, edge) = (vp.image_size, vp.longest_edge);
            let aspect = f64::from(img.width) / f64::from(img.height);
            let (mut w, mut h);
            if img.width >= img.height {
                w = edge;
                h = (f64::from(edge) / aspect) as u32;
                h += h % 2;
            } else {
                h = edge;
                w = (f64::from(edge) * aspect) as u32;
                w += w % 2;
            }
            // (A sliver of an image can round a side to 0; clip would fail there, pinfer keeps one pixel.)
            (w, h) = (w.max(1), h.max(1));
            let (gx, gy) = (w.div_ceil(tile), h.div_ceil(tile));
            let resized = resize(img, w, h, filter, Pad::None);
            let refined = resize(&resized, gx * tile, gy * tile, filter, Pad::None);
            let overview = resize(&refined, tile, tile, filter, Pad::None);
            let mut images = tiles(&refined, (gx, gy), tile, vp);
            images.push(normalized(&overview, vp));
            Ok(Preprocessed { images, grid: (gx, gy), overview: true })
        }
        Layout::SmartTiles => {
            let align = vp.patch_size * vp.n_merge;
            let (ow, oh) = dynamic_size(img.width, img.height, align, vp.min_pixels, vp.max_pixels);
            // The whole image, stretched to its dynamic size (no padding): alone when small,
            // else the thumbnail after the tiles.
            let overview = normalized(&resize(img, ow, oh, filter, Pad::None), vp);
            if !smart_tiles_needed(img.width, img.height, vp) {
                return Ok(one(overview));
            }
            let (gx, gy) = smart_tile_grid(img.width, img.height);
            // The image fitted into the grid (aspect kept, centred on black), then cut.
            let refined = resize(img, gx * SMART_TILE, gy * SMART_TILE, filter, Pad::Ceil);
            let mut images = tiles(&refined, (gx, gy), SMART_TILE, vp);
            images.push(overview);
            Ok(Preprocessed { images, grid: (gx, gy), overview: true })
        }
    }
}

/// LFM2-VL's tile side in pixels.
const SMART_TILE: u32 = crate::model::vision::LFM2_TILE;

/// LFM2-VL's tile grids (columns, rows), 2 to 10 tiles, in the order libmtmd tries them: by
/// tiles, and within a count in the order libstdc++'s `std::sort` (not stable) leaves them,
/// which decides between two grids exactly as far from the image's aspect.
const SMART_GRIDS: [(u32, u32); 26] = [
    (2, 1),
    (1, 2),
    (1, 3),
    (3, 1),
    (2, 2),
    (4, 1),
    (1, 4),
    (1, 5),
    (5, 1),
    (3, 2),
    (2, 3),
    (1, 6),
    (6, 1),
    (1, 7),
    (7, 1),
    (2, 4),
    (4, 2),
    (1, 8),
    (8, 1),
    (3, 3),
    (1, 9),
    (9, 1),
    (10, 1),
    (1, 10),
    (5, 2),
    (2, 5),
];

/// Whether LFM2-VL tiles a `width` x `height` image: when its sides rounded to the merged patch
/// (ties to even, in f64, as libmtmd) hold more than twice the most pixels of one input.
fn smart_tiles_needed(width: u32, height: u32, vp: &VisionParams) -> bool {
    let align = f64::from(vp.patch_size * vp.n_merge);
    let round = |x: u32| ((f64::from(x) / align).round_ties_even() * align).max(f64::from(vp.patch_size));
    round(height) * round(width) > vp.max_pixels as f64 * 2.0
}

/// The grid closest to the image's aspect (f32 as libmtmd); on a tie the later grid when the
/// image has more than half its pixels.
fn smart_tile_grid(width: u32, height: u32) -> (u32, u32) {
    let aspect = width as f32 / height as f32;
    let area = (u64::from(width) * u64::from(height)) as f32;
    let mut best = (1, 1);
    let mut best_diff = f32::MAX;
    for (w, h) in SMART_GRIDS {
        let diff = (aspect - w as f32 / h as f32).abs();
        if diff < best_diff {
            (best_diff, best) = (diff, (w, h));
        } else if diff == best_diff && area > 0.5 * (SMART_TILE * SMART_TILE * w * h) as f32 {
            best = (w, h);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_grids_are_every_grid_of_2_to_10_tiles_by_count() {
        let mut want: Vec<(u32, u32)> = (1..=10)
            .flat_map(|w| (1..=10).map(move |h| (w, h)))
            .filter(|(w, h)| (2..=10).contains(&(w * h)))
            .collect();
        let mut got = SMART_GRIDS.to_vec();
        assert!(got.windows(2).all(|p| p[0].0 * p[0].1 <= p[1].0 * p[1].1));
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn smart_tile_grids_follow_the_aspect() {
        assert_eq!(smart_tile_grid(3000, 200), (10, 1));
        assert_eq!(smart_tile_grid(200, 3000), (1, 10));
        assert_eq!(smart_tile_grid(1000, 1000), (2, 2));
        assert_eq!(smart_tile_grid(1536, 1024), (3, 2));
        assert_eq!(smart_tile_grid(2000, 800), (5, 2));
        // 5:4 is as far from 1:1 as from 3:2: the later grid when the image fills half of it.
        assert_eq!(smart_tile_grid(1250, 1000), (3, 3));
        assert_eq!(smart_tile_grid(125, 100), (2, 2));
    }
}
