//! Fuzzes image decoding (`pinfer::image::decode`: PNG, JPEG, GIF, BMP, PNM, TGA by their bytes)
//! within small limits, as a server's request images are decoded. A panic, an allocation past the
//! limits' size or an endless loop is a finding; an error is the expected answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinfer::image::{decode, ImageLimits};

fuzz_target!(|data: &[u8]| {
    let limits = ImageLimits { max_side: 1024, max_pixels: 1 << 20 };
    if let Ok(rgb) = decode(data, limits) {
        assert!(rgb.width as usize * rgb.height as usize * 3 == rgb.pixels.len());
        assert!(rgb.width <= 1024 && rgb.height <= 1024);
    }
});
