//! Fuzzes a vision projector (mmproj) file: `Gguf::parse`, then `check_projector` (the `clip.*`
//! keys and `v.*`/`mm.*` tensors of its family), and for a file it accepts the encoder planned for
//! its own square and for a small odd image (`VisionPlanned::new`, the graph and its memory plan),
//! the matrices it would repack and the preprocessing of a tiny image. A panic, an unbounded
//! allocation or an endless loop anywhere is a finding; an error is the expected answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pinfer::engine::vision::VisionPlanned;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = pinfer::gguf::Gguf::parse(data) else { return };
    let Ok(vp) = pinfer::model::vision::check_projector(&g) else { return };
    let Ok(mut slots) = pinfer::engine::heap::slots(1) else { return };
    let side = (vp.image_size as usize).min(448);
    for (w, h) in [(side, side), (vp.patch_size as usize * 3, vp.patch_size as usize * 2)] {
        if let Ok(planned) = VisionPlanned::new(data, &mut slots[0], w, h) {
            let _ = planned.packing();
            let _ = planned.bytes_needed();
        }
    }
    let rgb = pinfer::image::Rgb8 { width: 3, height: 2, pixels: vec![7; 18] };
    let _ = pinfer::image::preprocess(&rgb, &vp);
});
