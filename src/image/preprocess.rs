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
            images.push(normalized(&overview, vp));
            Ok(Preprocessed { images, grid: (gx, gy), overview: true })
        }
        Layout::SmartTiles => Err(ImageError::Unsupported(
            "LFM2-VL's tiling is not implemented yet in pinfer (its projector loads; images are refused)"
                .into(),
        )),
    }
}
