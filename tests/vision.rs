//! Vision projectors (mmproj files) and images: every family's file loads with the sizes it
//! declares; hostile and broken projector files and images are refused by name, never a panic;
//! Pillow's resampling gives the integers worked out by hand.

mod common;

use std::time::{Duration, Instant};

use common::{ggml, tag, GgufBuilder, Val};
use pinfer::gguf::Gguf;
use pinfer::image::{decode, preprocess, resize, ImageError, ImageLimits, Pad, Rgb8};
use pinfer::model::vision::{check_projector, Layout, Projector, Resample, VisionFfn, VisionParams};
use pinfer::model::ModelError;

/// Sizes of the test projectors: odd where the family allows.
struct Sizes {
    n_embd: u64,
    n_ff: u64,
    n_layer: u64,
    n_head: u64,
    image_size: u64,
    patch: u64,
    out: u64,
    merge: u64,
}

const SIZES: Sizes =
    Sizes { n_embd: 24, n_ff: 40, n_layer: 2, n_head: 3, image_size: 28, patch: 7, out: 20, merge: 2 };

fn f32s(v: &[f32]) -> Val {
    Val::Array(tag::F32, v.iter().map(|&x| Val::F32(x)).collect())
}

/// A projector file of `family` (random weights; every tensor the family's graph reads).
fn projector(family: Projector) -> GgufBuilder {
    let s = SIZES;
    let (e, f) = (s.n_embd, s.n_ff);
    let traits = family.traits();
    let mut g = GgufBuilder::new()
        .kv("general.architecture", Val::str("clip"))
        .kv("clip.projector_type", Val::str(family.name()))
        .kv("clip.has_vision_encoder", Val::Bool(1))
        .kv(
            "clip.use_gelu",
            Val::Bool(u8::from(family != Projector::Qwen25Vl && family != Projector::Qwen2Vl)),
        )
        .kv("clip.use_silu", Val::Bool(u8::from(family == Projector::Qwen25Vl)))
        .kv("clip.vision.embedding_length", Val::U32(e as u32))
        .kv("clip.vision.feed_forward_length", Val::U32(f as u32))
        .kv("clip.vision.block_count", Val::U32(s.n_layer as u32))
        .kv("clip.vision.attention.head_count", Val::U32(s.n_head as u32))
        .kv("clip.vision.attention.layer_norm_epsilon", Val::F32(1e-6))
        .kv("clip.vision.image_size", Val::U32(s.image_size as u32))
        .kv("clip.vision.patch_size", Val::U32(s.patch as u32))
        .kv("clip.vision.projection_dim", Val::U32(s.out as u32))
        .kv("clip.vision.image_mean", f32s(&[0.5, 0.5, 0.5]))
        .kv("clip.vision.image_std", f32s(&[0.5, 0.5, 0.5]));
    g = match traits.merge {
        pinfer::model::vision::Merge::SpatialMlp => {
            g.kv("clip.vision.spatial_merge_size", Val::U32(s.merge as u32))
        }
        _ => g.kv("clip.vision.projector.scale_factor", Val::U32(s.merge as u32)),
    };
    if family == Projector::Qwen25Vl {
        g = g.kv("clip.vision.n_wa_pattern", Val::U32(2));
    }
    if family == Projector::Idefics3 {
        g = g.kv("clip.vision.preproc_image_size", Val::U32(56));
    }
    let p = s.patch;
    g = g.tensor("v.patch_embd.weight", &[p, p, 3, e], ggml::F16);
    if traits.two_patch_convs {
        g = g.tensor("v.patch_embd.weight.1", &[p, p, 3, e], ggml::F16);
    }
    if traits.patch_bias {
        g = g.tensor("v.patch_embd.bias", &[e], ggml::F32);
    }
    if traits.positions != pinfer::model::vision::PatchPositions::Rope2d {
        let side = s.image_size / p;
        g = g.tensor("v.position_embd.weight", &[e, side * side], ggml::F32);
    }
    let layer_norm = traits.norm == pinfer::model::vision::VisionNorm::Layer;
    for i in 0..s.n_layer {
        for m in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            g = g.tensor(&format!("v.blk.{i}.{m}.weight"), &[e, e], ggml::F16);
            g = g.tensor(&format!("v.blk.{i}.{m}.bias"), &[e], ggml::F32);
        }
        for n in ["ln1", "ln2"] {
            g = g.tensor(&format!("v.blk.{i}.{n}.weight"), &[e], ggml::F32);
            if layer_norm {
                g = g.tensor(&format!("v.blk.{i}.{n}.bias"), &[e], ggml::F32);
            }
        }
        if family == Projector::Qwen25Vl {
            g = g.tensor(&format!("v.blk.{i}.ffn_gate.weight"), &[e, f], ggml::F16);
        }
        g = g.tensor(&format!("v.blk.{i}.ffn_up.weight"), &[e, f], ggml::F16);
        g = g.tensor(&format!("v.blk.{i}.ffn_down.weight"), &[f, e], ggml::F16);
    }
    let s2 = s.merge * s.merge;
    match family {
        Projector::Gemma3 => {
            g = g.tensor("v.post_ln.weight", &[e], ggml::F32).tensor("v.post_ln.bias", &[e], ggml::F32);
            g = g.tensor("mm.soft_emb_norm.weight", &[e], ggml::F32);
            g = g.tensor("mm.input_projection.weight", &[s.out, e], ggml::F16);
        }
        Projector::Idefics3 => g = g.tensor("mm.model.fc.weight", &[e * s2, s.out], ggml::F16),
        Projector::Lfm2 => {
            g = g.tensor("mm.1.weight", &[e * s2, 32], ggml::F16).tensor("mm.1.bias", &[32], ggml::F32);
            g = g.tensor("mm.2.weight", &[32, s.out], ggml::F16).tensor("mm.2.bias", &[s.out], ggml::F32);
        }
        Projector::Qwen2Vl | Projector::Qwen25Vl => {
            g = g.tensor("v.post_ln.weight", &[e], ggml::F32);
            if layer_norm {
                g = g.tensor("v.post_ln.bias", &[e], ggml::F32);
            }
            let h = e * s2;
            g = g.tensor("mm.0.weight", &[h, h], ggml::F16).tensor("mm.0.bias", &[h], ggml::F32);
            g = g.tensor("mm.2.weight", &[h, s.out], ggml::F16).tensor("mm.2.bias", &[s.out], ggml::F32);
        }
    }
    g
}

fn load(g: &GgufBuilder) -> Result<VisionParams, Box<ModelError>> {
    let bytes = g.bytes();
    let gguf = Gguf::parse(&bytes).expect("the test projector parses");
    check_projector(&gguf).map_err(Box::new)
}

#[test]
fn a_projector_of_each_family_loads_with_its_sizes() {
    for &family in Projector::ALL {
        let vp = load(&projector(family)).unwrap_or_else(|e| panic!("{}: {e}", family.name()));
        assert_eq!(vp.projector, family);
        assert_eq!((vp.n_embd, vp.n_ff, vp.n_layer, vp.n_head), (24, 40, 2, 3));
        assert_eq!((vp.image_size, vp.patch_size, vp.n_embd_out, vp.n_merge), (28, 7, 20, 2));
        assert_eq!(vp.head_dim(), 8);
        assert_eq!(vp.mean, [0.5; 3]);
        let expected_ffn = match family {
            Projector::Qwen2Vl => VisionFfn::GeluQuick,
            Projector::Qwen25Vl => VisionFfn::Silu,
            _ => VisionFfn::Gelu,
        };
        assert_eq!(vp.ffn, expected_ffn, "{}", family.name());
        // 4 x 4 patches of a 28 x 28 input, merged 2 x 2.
        assert_eq!(vp.tokens_for(28, 28), 4);
    }
    let qwen = load(&projector(Projector::Qwen2Vl)).unwrap();
    // 8..4096 tokens of (7 * 2)^2 pixels.
    assert_eq!((qwen.min_pixels, qwen.max_pixels), (8 * 196, 4096 * 196));
    assert_eq!(load(&projector(Projector::Qwen25Vl)).unwrap().n_wa_pattern, 2);
    assert_eq!(load(&projector(Projector::Idefics3)).unwrap().longest_edge, 56);
}

/// `g` with key `key` replaced by `v` (or removed).
fn with_key(mut g: GgufBuilder, key: &str, v: Option<Val>) -> GgufBuilder {
    let at = g.kvs.iter().position(|(k, _)| k == key);
    match (at, v) {
        (Some(i), Some(v)) => g.kvs[i].1 = v,
        (Some(i), None) => {
            g.kvs.remove(i);
        }
        (None, Some(v)) => g.kvs.push((key.to_string(), v)),
        (None, None) => {}
    }
    g
}

fn without_tensor(mut g: GgufBuilder, name: &str) -> GgufBuilder {
    g.tensors.retain(|t| t.name != name);
    g
}

fn with_tensor_dims(mut g: GgufBuilder, name: &str, dims: &[u64], ty: u32) -> GgufBuilder {
    g.tensors.retain(|t| t.name != name);
    g.tensor(name, dims, ty)
}

#[test]
fn broken_and_hostile_projectors_are_refused_by_name() {
    let base = projector(Projector::Gemma3);
    let cases: Vec<(&str, GgufBuilder, &str)> = vec![
        (
            "a model file",
            with_key(base.clone(), "general.architecture", Some(Val::str("llama"))),
            "not its projector",
        ),
        (
            "an audio projector",
            with_key(base.clone(), "clip.has_vision_encoder", Some(Val::Bool(0))),
            "no vision encoder",
        ),
        (
            "an unknown family",
            with_key(base.clone(), "clip.projector_type", Some(Val::str("frobnicate"))),
            "is unknown",
        ),
        (
            "another family",
            with_key(base.clone(), "clip.projector_type", Some(Val::str("pixtral"))),
            "is not supported",
        ),
        ("no family", with_key(base.clone(), "clip.projector_type", None), "clip.vision.projector_type"),
        (
            "a family of the wrong type",
            with_key(base.clone(), "clip.projector_type", Some(Val::U32(3))),
            "clip.projector_type",
        ),
        (
            "no width",
            with_key(base.clone(), "clip.vision.embedding_length", None),
            "clip.vision.embedding_length",
        ),
        (
            "a huge width",
            with_key(base.clone(), "clip.vision.embedding_length", Some(Val::U32(u32::MAX))),
            "out of range",
        ),
        (
            "a zero width",
            with_key(base.clone(), "clip.vision.embedding_length", Some(Val::U32(0))),
            "out of range",
        ),
        (
            "heads not dividing",
            with_key(base.clone(), "clip.vision.attention.head_count", Some(Val::U32(5))),
            "heads",
        ),
        (
            "a million layers",
            with_key(base.clone(), "clip.vision.block_count", Some(Val::U32(1 << 20))),
            "out of range",
        ),
        (
            "NaN epsilon",
            with_key(base.clone(), "clip.vision.attention.layer_norm_epsilon", Some(Val::F32(f32::NAN))),
            "(0, 1)",
        ),
        ("two means", with_key(base.clone(), "clip.vision.image_mean", Some(f32s(&[0.5, 0.5]))), "3 values"),
        (
            "zero deviation",
            with_key(base.clone(), "clip.vision.image_std", Some(f32s(&[0.5, 0.0, 0.5]))),
            "positive",
        ),
        ("both activations", with_key(base.clone(), "clip.use_silu", Some(Val::Bool(1))), "both"),
        (
            "image not whole patches",
            with_key(base.clone(), "clip.vision.image_size", Some(Val::U32(30))),
            "merged patches",
        ),
        ("zero patch", with_key(base.clone(), "clip.vision.patch_size", Some(Val::U32(0))), "out of range"),
        (
            "zero merge",
            with_key(base.clone(), "clip.vision.projector.scale_factor", Some(Val::U32(0))),
            "1..=16",
        ),
        ("a missing layer", without_tensor(base.clone(), "v.blk.1.attn_v.weight"), "v.blk.1.attn_v.weight"),
        (
            "a missing projection",
            without_tensor(base.clone(), "mm.input_projection.weight"),
            "mm.input_projection.weight",
        ),
        (
            "a wrong shape",
            with_tensor_dims(base.clone(), "v.blk.0.ffn_up.weight", &[24, 41], ggml::F16),
            "v.blk.0.ffn_up.weight",
        ),
        (
            "a projection to another width",
            with_tensor_dims(base.clone(), "mm.input_projection.weight", &[21, 24], ggml::F16),
            "[21, 24]",
        ),
        (
            "a quantized norm",
            with_tensor_dims(base.clone(), "mm.soft_emb_norm.weight", &[32], ggml::Q8_0),
            "mm.soft_emb_norm.weight",
        ),
        (
            "positions for another grid",
            with_tensor_dims(base.clone(), "v.position_embd.weight", &[24, 15], ggml::F32),
            "v.position_embd.weight",
        ),
        (
            "Qwen2.5-VL without a window pattern",
            with_key(projector(Projector::Qwen25Vl), "clip.vision.n_wa_pattern", None),
            "clip.vision.n_wa_pattern",
        ),
        (
            "a gated FFN without SiLU",
            with_key(projector(Projector::Qwen25Vl), "clip.use_silu", Some(Val::Bool(0))),
            "clip.use_silu",
        ),
    ];
    for (what, g, needle) in cases {
        let err = match load(&g) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{what}: {err:?} does not say {needle:?}");
    }
}

/// A PNG of `width` x `height` whose IHDR is valid (its CRC too) and whose data is `idat`.
fn png(width: u32, height: u32, color_type: u8, idat: &[u8]) -> Vec<u8> {
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(kind);
        crc.update(data);
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        out.extend_from_slice(&crc.finalize().to_be_bytes());
    }
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, color_type, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", idat);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn bad_images_are_refused_by_name() {
    let limits = ImageLimits::default();
    assert_eq!(decode(&[], limits), Err(ImageError::Empty));
    match decode(b"GIF? no: just some text", limits) {
        Err(ImageError::NotAnImage { magic }) => assert!(magic.starts_with("47 49 46 3f"), "{magic}"),
        other => panic!("text: {other:?}"),
    }
    // 60000 x 60000 declared: refused from the header, at once, before any pixel buffer.
    let started = Instant::now();
    match decode(&png(60000, 60000, 2, &[0x78, 0x9c, 0x03, 0x00]), limits) {
        Err(ImageError::TooLarge { width: 60000, height: 60000, .. }) => {}
        other => panic!("huge PNG: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    let msg = decode(&png(60000, 60000, 2, &[]), limits).unwrap_err().to_string();
    assert!(msg.contains("60000x60000") && msg.contains("before decoding"), "{msg}");
    // Within the limits but its data cut short / not zlib.
    for idat in [&[][..], &[0x78, 0x9c][..], &[1, 2, 3, 4, 5, 6][..]] {
        match decode(&png(4, 3, 2, idat), limits) {
            Err(ImageError::Corrupt(_)) => {}
            other => panic!("broken PNG data {idat:?}: {other:?}"),
        }
    }
    // A valid JPEG start, then nothing.
    match decode(&[0xff, 0xd8, 0xff, 0xe0, 0x00, 0x10, b'J', b'F', b'I', b'F', 0], limits) {
        Err(ImageError::Corrupt(_)) => {}
        other => panic!("cut JPEG: {other:?}"),
    }
    // Tighter limits apply per side and per pixel count.
    let small = ImageLimits { max_side: 100, max_pixels: 2000 };
    assert!(matches!(decode(&png(101, 1, 2, &[]), small), Err(ImageError::TooLarge { .. })));
    assert!(matches!(decode(&png(50, 50, 2, &[]), small), Err(ImageError::TooLarge { .. })));
}

#[test]
fn images_of_every_colour_type_become_rgb_as_stb_image_makes_them() {
    use image::ImageEncoder;
    let (w, h) = (5u32, 3u32);
    let encode = |data: &[u8], color: image::ExtendedColorType| {
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out).write_image(data, w, h, color).unwrap();
        out
    };
    let n = (w * h) as usize;
    let grey: Vec<u8> = (0..n).map(|i| (i * 17) as u8).collect();
    let rgb = decode(&encode(&grey, image::ExtendedColorType::L8), ImageLimits::default()).unwrap();
    assert_eq!((rgb.width, rgb.height), (w, h));
    assert_eq!(rgb.pixels, grey.iter().flat_map(|&y| [y, y, y]).collect::<Vec<_>>());
    // Alpha dropped, not blended.
    let rgba: Vec<u8> = (0..n).flat_map(|i| [i as u8, 100, 200, (i * 13) as u8]).collect();
    let rgb = decode(&encode(&rgba, image::ExtendedColorType::Rgba8), ImageLimits::default()).unwrap();
    assert_eq!(rgb.pixels, (0..n).flat_map(|i| [i as u8, 100, 200]).collect::<Vec<_>>());
    // 16-bit samples keep their high byte (the encoder takes native-endian samples).
    let wide: Vec<u8> = (0..n)
        .flat_map(|i| [((i as u16 * 16) << 8) | 0xff, 0x0780, 0xff01])
        .flat_map(u16::to_ne_bytes)
        .collect();
    let rgb = decode(&encode(&wide, image::ExtendedColorType::Rgb16), ImageLimits::default()).unwrap();
    assert_eq!(rgb.pixels, (0..n).flat_map(|i| [(i * 16) as u8, 7, 0xff]).collect::<Vec<_>>());
}

#[test]
fn pillow_resampling_gives_the_integers_worked_out_by_hand() {
    // A row of 4 pixels to 2, bilinear: the filter widens to 2 input pixels; output 0 weighs
    // pixels 0..3 by 3/7, 3/7, 1/7, output 1 pixels 1..4 by 1/7, 3/7, 3/7.
    let row = Rgb8 {
        width: 4,
        height: 1,
        pixels: [0u8, 70, 140, 210].iter().flat_map(|&v| [v, v, 255 - v]).collect(),
    };
    let out = resize(&row, 2, 1, Resample::Bilinear, Pad::None);
    assert_eq!(out.pixels, vec![50, 50, 205, 160, 160, 95]);
    // The same down a column.
    let col = Rgb8 { width: 1, height: 4, ..row.clone() };
    assert_eq!(resize(&col, 1, 2, Resample::Bilinear, Pad::None).pixels, out.pixels);
    // One colour stays that colour under every filter, growing and shrinking.
    let flat = Rgb8::filled(7, 5, [9, 200, 77]);
    for filter in [Resample::Bilinear, Resample::Bicubic, Resample::Lanczos] {
        for (w, h) in [(3, 2), (16, 11), (7, 9), (1, 1)] {
            assert_eq!(
                resize(&flat, w, h, filter, Pad::None),
                Rgb8::filled(w, h, [9, 200, 77]),
                "{filter:?} {w}x{h}"
            );
        }
    }
    // Fitting a wide image in a square: scaled to the width, centred between black bars.
    let wide = Rgb8::filled(30, 10, [255, 255, 255]);
    let fitted = resize(&wide, 12, 12, Resample::Bilinear, Pad::Ceil);
    let row_of = |y: usize| &fitted.pixels[y * 36..][..36];
    assert!(row_of(3).iter().all(|&v| v == 0) && row_of(8).iter().all(|&v| v == 0));
    assert!((4..8).all(|y| row_of(y).iter().all(|&v| v == 255)));
}

#[test]
fn the_layouts_give_the_sizes_clip_gives() {
    let gemma = load(&projector(Projector::Gemma3)).unwrap();
    assert_eq!(gemma.traits().layout, Layout::Fixed);
    let img = Rgb8::filled(3000, 200, [10, 20, 30]);
    let pre = preprocess(&img, &gemma).unwrap();
    assert_eq!(pre.images.len(), 1);
    assert_eq!((pre.images[0].width, pre.images[0].height), (28, 28));
    // Black bars normalise to -1 with mean = std = 0.5; the image's rows to (v/255 - .5) / .5.
    assert_eq!(pre.images[0].pixels[0], -1.0);
    let mid = &pre.images[0].pixels[(14 * 28) * 3..][..3];
    assert_eq!(mid, [(10.0 / 255.0 - 0.5) / 0.5, (20.0 / 255.0 - 0.5) / 0.5, (30.0 / 255.0 - 0.5) / 0.5]);

    // Qwen: sides rounded to merged patches (14 px), kept within 8..4096 tokens.
    let qwen = load(&projector(Projector::Qwen2Vl)).unwrap();
    for ((w, h), expected) in
        [((1, 1), (42, 42)), ((3000, 200), (2996, 196)), ((100, 37), (98, 42)), ((20000, 15000), (1022, 770))]
    {
        let got = pinfer::image::dynamic_size(w, h, 14, qwen.min_pixels, qwen.max_pixels);
        assert_eq!(got, expected, "{w}x{h}");
        assert!(u64::from(got.0) * u64::from(got.1) <= qwen.max_pixels);
    }

    // SmolVLM: the longest edge to 56, both sides up to multiples of the 28 px tile, then the
    // whole image as the last tile.
    let smol = load(&projector(Projector::Idefics3)).unwrap();
    let pre = preprocess(&Rgb8::filled(90, 40, [1, 2, 3]), &smol).unwrap();
    assert_eq!((pre.grid, pre.overview, pre.images.len()), ((2, 1), true, 3));
    assert!(pre.images.iter().all(|t| (t.width, t.height) == (28, 28)));
}
