//! Pillow's separable resampling as clip computes it: per output pixel a normalised window of
//! filter weights (widened when shrinking), rounded to 22-bit fixed point; a horizontal pass
//! then a vertical one, each rounding to 8 bits. Same integers, so the same bytes as libmtmd.

use std::vec;
use std::vec::Vec;

use super::Rgb8;
use crate::model::vision::Resample;

/// Fraction bits of the fixed-point weights: 32 bits less 8 for the pixel and 2 of headroom.
const PRECISION_BITS: u32 = 22;

/// How an image that does not have the target's aspect is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pad {
    /// Stretched to the target.
    None,
    /// Scaled to fit (sides rounded up, at most the target's), centred on black.
    Ceil,
    /// Scaled to fit (sides rounded to nearest), centred on black.
    Nearest,
}

impl Resample {
    /// Half-width of the filter at scale 1.
    fn support(self) -> f64 {
        match self {
            Resample::Bilinear => 1.0,
            Resample::Bicubic => 2.0,
            Resample::Lanczos => 3.0,
        }
    }

    /// The filter's weight at distance `x` (in input pixels at scale 1).
    fn weight(self, x: f64) -> f64 {
        match self {
            Resample::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
            Resample::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Resample::Bicubic => {
                // Pillow's a = -0.5 (PyTorch's is -0.75).
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        1.0
    } else {
        let px = x * core::f64::consts::PI;
        px.sin() / px
    }
}

/// The windows of one dimension: per output pixel its first input pixel, and `ksize` weights.
struct Windows {
    ksize: usize,
    /// (first input pixel, input pixels) per output pixel.
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn windows(filter: Resample, in_size: usize, out_size: usize) -> Windows {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut w = vec![0f64; ksize];
    let fixed = f64::from(1u32 << PRECISION_BITS);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // (Truncation toward zero, as C's int conversion; both values are >= -support + 0.5.)
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut total = 0.0;
        for (x, slot) in w.iter_mut().enumerate().take(n) {
            *slot = filter.weight((x as f64 + xmin as f64 - center + 0.5) * ss);
            total += *slot;
        }
        for (x, out) in weights[xx * ksize..][..ksize].iter_mut().enumerate() {
            let v = if x < n && total != 0.0 {
                w[x] / total
            } else if x < n {
                w[x]
            } else {
                0.0
            };
            // Pillow adds +-0.5 and truncates.
            *out = (v * fixed + if v < 0.0 { -0.5 } else { 0.5 }) as i32;
        }
        bounds.push((xmin, n));
    }
    Windows { ksize, bounds, weights }
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

fn horizontal(src: &[u8], in_nx: usize, ny: usize, out_nx: usize, win: &Windows) -> Vec<u8> {
    let mut out = vec![0u8; out_nx * ny * 3];
    let half = 1i64 << (PRECISION_BITS - 1);
    for y in 0..ny {
        let row = &src[y * in_nx * 3..][..in_nx * 3];
        let dst = &mut out[y * out_nx * 3..][..out_nx * 3];
        for (xx, px) in dst.chunks_exact_mut(3).enumerate() {
            let (first, n) = win.bounds[xx];
            let k = &win.weights[xx * win.ksize..][..n];
            let mut acc = [half; 3];
            for (x, &w) in k.iter().enumerate() {
                let p = &row[(first + x) * 3..][..3];
                for c in 0..3 {
                    acc[c] += i64::from(p[c]) * i64::from(w);
                }
            }
            for c in 0..3 {
                px[c] = clip8(acc[c]);
            }
        }
    }
    out
}

fn vertical(src: &[u8], nx: usize, out_ny: usize, win: &Windows) -> Vec<u8> {
    let row_len = nx * 3;
    let mut out = vec![0u8; row_len * out_ny];
    let mut acc = vec![0i64; row_len];
    for yy in 0..out_ny {
        let (first, n) = win.bounds[yy];
        acc.fill(1i64 << (PRECISION_BITS - 1));
        for (y, &w) in win.weights[yy * win.ksize..][..n].iter().enumerate() {
            let row = &src[(first + y) * row_len..][..row_len];
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += i64::from(p) * i64::from(w);
            }
        }
        for (o, &a) in out[yy * row_len..][..row_len].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    out
}

/// `img` resampled to exactly `width` x `height` (both at least 1).
fn stretch(img: &Rgb8, width: u32, height: u32, filter: Resample) -> Rgb8 {
    let (w, h) = (img.width as usize, img.height as usize);
    let (tw, th) = (width as usize, height as usize);
    let pixels = match (tw != w, th != h) {
        (false, false) => img.pixels.clone(),
        (true, false) => horizontal(&img.pixels, w, h, tw, &windows(filter, w, tw)),
        (false, true) => vertical(&img.pixels, w, th, &windows(filter, h, th)),
        (true, true) => {
            let wide = horizontal(&img.pixels, w, h, tw, &windows(filter, w, tw));
            vertical(&wide, tw, th, &windows(filter, h, th))
        }
    };
    Rgb8 { width, height, pixels }
}

/// `img` resized to `width` x `height` as clip's `img_tool::resize` does: stretched (`Pad::None`)
/// or fitted inside and centred on black.
pub fn resize(img: &Rgb8, width: u32, height: u32, filter: Resample, pad: Pad) -> Rgb8 {
    if img.width == width && img.height == height {
        return img.clone();
    }
    if pad == Pad::None {
        return stretch(img, width, height, filter);
    }
    // (f32 as clip computes the scale.)
    let scale = (width as f32 / img.width as f32).min(height as f32 / img.height as f32);
    let fit = |side: u32, target: u32| -> u32 {
        let v = side as f32 * scale;
        let v = if pad == Pad::Nearest { v.round() } else { v.ceil() };
        (v as u32).min(target).max(1)
    };
    let (nw, nh) = (fit(img.width, width), fit(img.height, height));
    let inner = stretch(img, nw, nh, filter);
    let (ox, oy) = if pad == Pad::Nearest {
        (((width - nw) as f32 / 2.0).round() as u32, ((height - nh) as f32 / 2.0).round() as u32)
    } else {
        ((width - nw) / 2, (height - nh) / 2)
    };
    let mut out = Rgb8::filled(width, height, [0, 0, 0]);
    let row = nw as usize * 3;
    for y in 0..nh as usize {
        let dst = ((oy as usize + y) * width as usize + ox as usize) * 3;
        out.pixels[dst..dst + row].copy_from_slice(&inner.pixels[y * row..][..row]);
    }
    out
}
