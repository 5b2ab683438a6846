//! std: images for the vision projectors. Decoding (PNG, JPEG, GIF, BMP, PNM, TGA: what
//! llama.cpp's stb_image reads that a pure-Rust decoder does too) with the size checked from the
//! header before any pixel is allocated, then clip's preprocessing: Pillow's resampling in fixed
//! point, black padding, tiles, and the per-channel normalisation, so the encoder sees the pixel
//! values libmtmd gives it.

mod preprocess;
mod resample;

pub use preprocess::{dynamic_size, preprocess, EncoderImage, Preprocessed};
pub use resample::{resize, Pad};

use std::fmt;
use std::format;
use std::io::Cursor;
use std::string::{String, ToString};
use std::vec::Vec;

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (R, G, B).
#[derive(Clone, PartialEq, Eq)]
pub struct Rgb8 {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `width * height * 3` bytes.
    pub pixels: Vec<u8>,
}

impl fmt::Debug for Rgb8 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Rgb8({}x{})", self.width, self.height)
    }
}

impl Rgb8 {
    /// An image of one colour.
    pub fn filled(width: u32, height: u32, rgb: [u8; 3]) -> Self {
        let n = width as usize * height as usize;
        Self { width, height, pixels: rgb.iter().copied().cycle().take(n * 3).collect() }
    }
}

/// What an image may be before it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Most pixels.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// 16384 pixels a side and 64 megapixels (a 8K camera frame fits; its decoded RGBA16 is
    /// 512 MiB at most).
    fn default() -> Self {
        Self { max_side: 16384, max_pixels: 64 << 20 }
    }
}

/// Why bytes are not an image pinfer takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageError {
    /// No bytes.
    Empty,
    /// Not a format pinfer decodes (the first bytes, in hex, to say what it is).
    NotAnImage {
        /// The first bytes.
        magic: String,
    },
    /// Larger than the limits (from the header: nothing was decoded).
    TooLarge {
        /// Width declared.
        width: u32,
        /// Height declared.
        height: u32,
        /// The limits.
        limits: ImageLimits,
    },
    /// A format pinfer decodes but a variant it does not (named).
    Unsupported(String),
    /// Truncated or corrupt data.
    Corrupt(String),
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the image is empty (0 bytes)"),
            Self::NotAnImage { magic } => write!(
                f,
                "not an image pinfer decodes (PNG, JPEG, GIF, BMP, PNM, TGA); the data starts with {magic}"
            ),
            Self::TooLarge { width, height, limits } => write!(
                f,
                "the image is {width}x{height}: over the limit of {} pixels a side and {} megapixels \
                 (refused before decoding)",
                limits.max_side,
                limits.max_pixels >> 20
            ),
            Self::Unsupported(what) => write!(f, "unsupported image: {what}"),
            Self::Corrupt(what) => write!(f, "the image is truncated or corrupt: {what}"),
        }
    }
}

impl std::error::Error for ImageError {}

/// Decodes `bytes` into 8-bit RGB as stb_image does with 3 channels asked for: grey is copied to
/// the three channels, alpha is dropped (not blended), 16-bit samples keep their high byte, a
/// palette is expanded, an animation gives its first frame; orientation tags are not applied.
pub fn decode(bytes: &[u8], limits: ImageLimits) -> Result<Rgb8, ImageError> {
    use image::ImageDecoder;
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    if reader.format().is_none() {
        let magic = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ");
        return Err(ImageError::NotAnImage { magic });
    }
    let mut decoder = reader.into_decoder().map_err(image_error)?;
    let (width, height) = decoder.dimensions();
    let pixels = u64::from(width) * u64::from(height);
    if width > limits.max_side || height > limits.max_side || pixels > limits.max_pixels {
        return Err(ImageError::TooLarge { width, height, limits });
    }
    if width == 0 || height == 0 {
        return Err(ImageError::Corrupt(format!("{width}x{height} pixels")));
    }
    let mut dec_limits = image::Limits::default();
    dec_limits.max_image_width = Some(limits.max_side);
    dec_limits.max_image_height = Some(limits.max_side);
    // The decoded pixels (at most 8 bytes each) and the decoder's own buffers.
    dec_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8).saturating_add(64 << 20));
    decoder.set_limits(dec_limits).map_err(image_error)?;
    let color = decoder.color_type();
    let size =
        usize::try_from(decoder.total_bytes()).map_err(|_| ImageError::TooLarge { width, height, limits })?;
    let mut raw = Vec::new();
    raw.try_reserve_exact(size).map_err(|_| ImageError::TooLarge { width, height, limits })?;
    raw.resize(size, 0u8);
    decoder.read_image(&mut raw).map_err(image_error)?;
    let rgb = to_rgb8(&raw, color, pixels as usize)?;
    Ok(Rgb8 { width, height, pixels: rgb })
}

/// stb_image's conversion to 3 channels of 8 bits.
fn to_rgb8(raw: &[u8], color: image::ColorType, n: usize) -> Result<Vec<u8>, ImageError> {
    use image::ColorType as C;
    let (channels, wide) = match color {
        C::L8 => (1, false),
        C::La8 => (2, false),
        C::Rgb8 => (3, false),
        C::Rgba8 => (4, false),
        C::L16 => (1, true),
        C::La16 => (2, true),
        C::Rgb16 => (3, true),
        C::Rgba16 => (4, true),
        other => return Err(ImageError::Unsupported(format!("{other:?} samples"))),
    };
    // (16-bit samples come native-endian from the decoder; stb keeps the high byte.)
    let sample = |i: usize| -> u8 {
        if wide {
            (u16::from_ne_bytes([raw[2 * i], raw[2 * i + 1]]) >> 8) as u8
        } else {
            raw[i]
        }
    };
    let mut out = Vec::with_capacity(n * 3);
    for p in 0..n {
        let at = p * channels;
        if channels < 3 {
            let y = sample(at);
            out.extend_from_slice(&[y, y, y]);
        } else {
            out.extend_from_slice(&[sample(at), sample(at + 1), sample(at + 2)]);
        }
    }
    Ok(out)
}

fn image_error(e: image::ImageError) -> ImageError {
    use image::ImageError as E;
    match e {
        E::Unsupported(u) => ImageError::Unsupported(u.to_string()),
        E::Limits(l) => ImageError::Unsupported(format!("over the decoder's limits ({l})")),
        other => ImageError::Corrupt(other.to_string()),
    }
}
