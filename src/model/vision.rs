//! Vision projectors: llama.cpp's `mmproj` files (`general.architecture = "clip"`), read and
//! checked as strictly as model files. A projector is a ViT image encoder (`v.*` tensors) and the
//! projector proper (`mm.*`) that turns its patch vectors into the language model's embeddings.
//!
//! What sets a projector family apart is written once, in [`Projector::traits`]: how an image is
//! resized and cut before the encoder, how patches are positioned, which norm and FFN the ViT
//! has, and how its output is merged. Families llama.cpp has and pinfer does not run are refused by
//! name.

use core::fmt::Write;

use super::validate::TensorKind;
use super::ModelError;
use crate::gguf::{name_of, Gguf, Name, Value, ValueType};

/// The projector families pinfer runs, with their `clip.projector_type` names.
macro_rules! projectors {
    ($($variant:ident => $name:literal,)*) => {
        /// A projector family (`clip.projector_type`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Projector {
            $(#[doc = concat!("`", $name, "`")] $variant,)*
        }

        impl Projector {
            /// Every family pinfer runs.
            pub const ALL: &'static [Projector] = &[$(Projector::$variant,)*];

            /// The family's name in files.
            pub fn name(self) -> &'static str {
                match self { $(Projector::$variant => $name,)* }
            }

            /// The family named `name` in a file.
            pub fn from_name(name: &str) -> Option<Self> {
                match name { $($name => Some(Projector::$variant),)* _ => None }
            }
        }
    };
}

projectors! {
    Gemma3 => "gemma3",
    Idefics3 => "idefics3",
    Qwen2Vl => "qwen2vl_merger",
    Qwen25Vl => "qwen2.5vl_merger",
    Lfm2 => "lfm2",
}

/// How clip resizes an image (Pillow's filters, fixed-point as Pillow computes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// Triangle filter, support 1.
    Bilinear,
    /// Cubic with a = -0.5, support 2.
    Bicubic,
    /// Lanczos, support 3.
    Lanczos,
}

/// How an image becomes the encoder's input images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One square of `image_size`, the image fitted inside it (aspect kept, black bars).
    Fixed,
    /// One image of its own size rounded to the merged patch (`patch_size * n_merge`), kept
    /// between the projector's least and most pixels, fitted (aspect kept, a few black pixels).
    Dynamic,
    /// Tiles of `image_size` cut from the image resized to a multiple of it, then the whole
    /// image as one more tile (SmolVLM).
    Tiles,
    /// LFM2-VL: dynamic size when small, else 512 tiles and a thumbnail.
    SmartTiles,
}

/// Where a patch is, to the ViT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchPositions {
    /// A learned embedding per patch (`v.position_embd.weight`), added to the patch vectors.
    Learned,
    /// A learned embedding resized to the patch grid (bilinear, antialiased): LFM2-VL.
    LearnedResized,
    /// 2-D rotary positions (row and column) in every attention: Qwen2-VL.
    Rope2d,
}

/// The norm of the ViT's layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionNorm {
    /// LayerNorm with weight and bias.
    Layer,
    /// RMSNorm with a weight.
    Rms,
}

/// How the ViT's patch vectors become the language model's embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Average pooling of `n_merge` x `n_merge` patches, RMSNorm times `mm.soft_emb_norm`, then
    /// `mm.input_projection` (Gemma 3).
    PoolNormProject,
    /// Pixel shuffle of `n_merge` x `n_merge` patches into one vector, then `mm.model.fc`.
    ShuffleLinear,
    /// Pixel shuffle, an optional LayerNorm, then `mm.1` - GELU - `mm.2` (LFM2-VL).
    ShuffleMlp,
    /// 2 x 2 spatial merge after `v.post_ln`, then `mm.0` - GELU - `mm.2` (Qwen2-VL).
    SpatialMlp,
}

/// The tokens that wrap an image's embeddings in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wrap {
    /// `<start_of_image>` embeddings `<end_of_image>`.
    Gemma3,
    /// Per tile `<fake_token_around_image><row_R_col_C>` embeddings, then the global image.
    Idefics3,
    /// `<|vision_start|>` embeddings `<|vision_end|>`.
    Qwen,
    /// `<|image_start|>` tiles with `<|img_row_R_col_C|>`, `<|img_thumbnail|>`, `<|image_end|>`.
    Lfm2,
}

/// What sets a projector family apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectorTraits {
    /// The resize filter.
    pub resample: Resample,
    /// How the image is sized and cut.
    pub layout: Layout,
    /// Patch positions.
    pub positions: PatchPositions,
    /// The ViT's norms.
    pub norm: VisionNorm,
    /// The patch embedding has a bias (`v.patch_embd.bias`).
    pub patch_bias: bool,
    /// Two patch convolutions over the same image, summed (`v.patch_embd.weight.1`: Qwen2-VL's
    /// Conv3D split in two frames).
    pub two_patch_convs: bool,
    /// The merge and projection.
    pub merge: Merge,
    /// Patches merged per side when the file does not say.
    pub default_merge: u32,
    /// The image's wrapper tokens.
    pub wrap: Wrap,
    /// The language model attends both ways inside the image (Gemma 3).
    pub bidirectional_image: bool,
    /// The language model places image tokens by M-RoPE (time, row, column).
    pub mrope: bool,
    /// Least and most image tokens (dynamic layouts; 0: the family has no limit).
    pub tokens: (u32, u32),
}

impl Projector {
    /// The family's facts (clip.cpp's per-projector settings and graphs).
    pub const fn traits(self) -> ProjectorTraits {
        use Projector::*;
        let base = ProjectorTraits {
            resample: Resample::Bilinear,
            layout: Layout::Fixed,
            positions: PatchPositions::Learned,
            norm: VisionNorm::Layer,
            patch_bias: true,
            two_patch_convs: false,
            merge: Merge::PoolNormProject,
            default_merge: 4,
            wrap: Wrap::Gemma3,
            bidirectional_image: false,
            mrope: false,
            tokens: (0, 0),
        };
        match self {
            Gemma3 => ProjectorTraits { bidirectional_image: true, ..base },
            Idefics3 => ProjectorTraits {
                resample: Resample::Lanczos,
                layout: Layout::Tiles,
                merge: Merge::ShuffleLinear,
                default_merge: 3,
                wrap: Wrap::Idefics3,
                ..base
            },
            Lfm2 => ProjectorTraits {
                layout: Layout::SmartTiles,
                positions: PatchPositions::LearnedResized,
                merge: Merge::ShuffleMlp,
                default_merge: 2,
                wrap: Wrap::Lfm2,
                tokens: (64, 256),
                ..base
            },
            Qwen2Vl | Qwen25Vl => ProjectorTraits {
                resample: Resample::Bicubic,
                layout: Layout::Dynamic,
                positions: PatchPositions::Rope2d,
                norm: if matches!(self, Qwen25Vl) { VisionNorm::Rms } else { VisionNorm::Layer },
                patch_bias: false,
                two_patch_convs: true,
                merge: Merge::SpatialMlp,
                default_merge: 2,
                wrap: Wrap::Qwen,
                mrope: true,
                tokens: (8, 4096),
                ..base
            },
        }
    }
}

/// The side of LFM2-VL's tiles in pixels (clip's, whatever the file's image size).
pub const LFM2_TILE: u32 = 512;

/// Projector families llama.cpp has that pinfer does not run (refused by name).
pub const OTHER_PROJECTORS: &[&str] = &[
    "mlp",
    "ldp",
    "ldpv2",
    "resampler",
    "glm_edge",
    "pixtral",
    "qwen3vl_merger",
    "internvl",
    "llama4",
    "ultravox",
    "qwen2a",
    "qwen2.5o",
    "voxtral",
    "kimivl",
    "cogvlm",
    "janus_pro",
    "gemma3nv",
    "gemma3na",
    "gemma4v",
    "phi4",
    "minicpmv",
];

/// The activation of the ViT's FFN (`clip.use_gelu`, `clip.use_silu`, else GELU-quick).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionFfn {
    /// GELU (tanh approximation), no gate.
    Gelu,
    /// SiLU; gated (SwiGLU) when the layers have `ffn_gate`.
    Silu,
    /// x * sigmoid(1.702 x), no gate.
    GeluQuick,
}

/// Largest values accepted for a projector's sizes (far above any released model: a file beyond
/// them is hostile or broken).
const MAX_EMBD: u32 = 1 << 14;
const MAX_LAYERS: u32 = 128;
const MAX_IMAGE_SIZE: u32 = 1 << 13;

/// A projector's hyper-parameters, checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VisionParams {
    /// The family.
    pub projector: Projector,
    /// Width of the ViT.
    pub n_embd: u32,
    /// Width of its FFN.
    pub n_ff: u32,
    /// Layers.
    pub n_layer: u32,
    /// Attention heads.
    pub n_head: u32,
    /// Norm epsilon.
    pub eps: f32,
    /// Side of the encoder's square input (fixed layouts, tiles), in pixels.
    pub image_size: u32,
    /// Side of a patch, in pixels.
    pub patch_size: u32,
    /// Per-channel mean and deviation of the normalisation.
    pub mean: [f32; 3],
    /// See `mean`.
    pub std: [f32; 3],
    /// Patches merged per side.
    pub n_merge: u32,
    /// Width of the embeddings it produces (the language model's `n_embd`).
    pub n_embd_out: u32,
    /// The FFN's activation.
    pub ffn: VisionFfn,
    /// Least and most pixels of a dynamic layout's image (0: none).
    pub min_pixels: u64,
    /// See `min_pixels`.
    pub max_pixels: u64,
    /// Longest edge an image is resized to before tiling (SmolVLM's `preproc_image_size`; 0: none).
    pub longest_edge: u32,
    /// Qwen2.5-VL: every `n_wa_pattern`-th layer attends over the whole image, the others within
    /// windows (0: every layer over the whole image).
    pub n_wa_pattern: u32,
    /// Qwen2.5-VL: side of an attention window in pixels (clip's 112; whole merged patches
    /// count, as clip divides). 0 for the other families.
    pub window_size: u32,
}

impl VisionParams {
    /// Reads and checks a projector file's keys.
    pub fn read(g: &Gguf<'_>) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "clip" {
            return Err(ModelError::BadKey {
                key: name_of("general.architecture"),
                found: name_of(arch),
                problem:
                    "a projector (mmproj) file is a \"clip\" file; this looks like a model, not its projector",
            });
        }
        if g.get_bool_opt("clip.has_vision_encoder")? != Some(true) {
            return Err(ModelError::BadKey {
                key: name_of("clip.has_vision_encoder"),
                found: name_of("absent or false"),
                problem:
                    "this projector has no vision encoder (an audio projector?): pinfer reads images only",
            });
        }
        let family = match g.get_str_opt("clip.projector_type")? {
            Some(name) => name,
            None => g.get_str("clip.vision.projector_type")?,
        };
        let projector = Projector::from_name(family).ok_or_else(|| ModelError::UnsupportedProjector {
            name: name_of(family),
            known: OTHER_PROJECTORS.contains(&family),
        })?;
        let traits = projector.traits();
        let u32_key = |key: &str, min: u32, max: u32| -> Result<u32, ModelError> {
            let v = g.get_u32(key)?;
            if v < min || v > max {
                return Err(bad(key, v as f64, "out of range"));
            }
            Ok(v)
        };
        let opt_u32 = |key: &str| -> Result<Option<u32>, ModelError> { Ok(g.get_int::<u32>(key)?) };
        let n_embd = u32_key("clip.vision.embedding_length", 1, MAX_EMBD)?;
        let n_ff = u32_key("clip.vision.feed_forward_length", 1, 4 * MAX_EMBD)?;
        let n_layer = u32_key("clip.vision.block_count", 1, MAX_LAYERS)?;
        let n_head = u32_key("clip.vision.attention.head_count", 1, n_embd)?;
        if n_embd % n_head != 0 || (n_embd / n_head) % 2 != 0 && traits.positions == PatchPositions::Rope2d {
            return Err(bad(
                "clip.vision.attention.head_count",
                n_head as f64,
                "does not divide the width into heads",
            ));
        }
        if let Some(kv) = opt_u32("clip.vision.attention.head_count_kv")? {
            if kv != n_head {
                return Err(bad(
                    "clip.vision.attention.head_count_kv",
                    kv as f64,
                    "grouped heads in a ViT are not supported",
                ));
            }
        }
        let eps = g.get_f32("clip.vision.attention.layer_norm_epsilon")?;
        if !(eps > 0.0 && eps < 1.0) {
            return Err(bad("clip.vision.attention.layer_norm_epsilon", eps as f64, "must be in (0, 1)"));
        }
        let image_size = u32_key("clip.vision.image_size", 1, MAX_IMAGE_SIZE)?;
        let patch_size = u32_key("clip.vision.patch_size", 1, 64)?;
        let n_embd_out = u32_key("clip.vision.projection_dim", 1, 4 * MAX_EMBD)?;
        let n_merge = match traits.merge {
            Merge::SpatialMlp => opt_u32("clip.vision.spatial_merge_size")?,
            _ => opt_u32("clip.vision.projector.scale_factor")?,
        }
        .unwrap_or(traits.default_merge);
        if n_merge == 0 || n_merge > 16 {
            return Err(bad("clip.vision.projector.scale_factor", n_merge as f64, "must be 1..=16"));
        }
        if traits.layout != Layout::Dynamic {
            let side = image_size / patch_size;
            if image_size % patch_size != 0 || side % n_merge != 0 && traits.merge == Merge::PoolNormProject {
                return Err(bad(
                    "clip.vision.image_size",
                    image_size as f64,
                    "is not a whole number of merged patches",
                ));
            }
        }
        let use_gelu = g.get_bool_opt("clip.use_gelu")?.unwrap_or(false);
        let use_silu = g.get_bool_opt("clip.use_silu")?.unwrap_or(false);
        let ffn = match (use_gelu, use_silu) {
            (true, true) => {
                return Err(bad("clip.use_silu", 1.0, "both clip.use_gelu and clip.use_silu are set"))
            }
            (true, false) => VisionFfn::Gelu,
            (false, true) => VisionFfn::Silu,
            (false, false) => VisionFfn::GeluQuick,
        };
        let channels = |key: &str| -> Result<[f32; 3], ModelError> {
            let a = g.get_array(key, ValueType::F32)?;
            if a.len() < 3 {
                return Err(bad(key, a.len() as f64, "needs 3 values (R, G, B)"));
            }
            let mut v = [0f32; 3];
            for (i, slot) in v.iter_mut().enumerate() {
                let Some(Value::F32(x)) = a.get_fixed(i) else {
                    return Err(bad(key, i as f64, "not a number"));
                };
                *slot = x;
            }
            Ok(v)
        };
        let mean = channels("clip.vision.image_mean")?;
        let std = channels("clip.vision.image_std")?;
        for (i, (&m, &s)) in mean.iter().zip(&std).enumerate() {
            if !(m.is_finite() && s.is_finite() && s > 0.0) {
                return Err(bad(
                    "clip.vision.image_std",
                    i as f64,
                    "means must be finite and deviations positive",
                ));
            }
        }
        let patch_area = u64::from(patch_size * n_merge).pow(2);
        let (min_tokens, max_tokens) = traits.tokens;
        let n_wa_pattern = match projector {
            Projector::Qwen25Vl => u32_key("clip.vision.n_wa_pattern", 1, n_layer)?,
            _ => 0,
        };
        // clip (0c1e570) does not read `clip.vision.window_size` for this family: its windows
        // are 112 pixels whatever the file says (released Qwen2.5-VL files say 112 too).
        let window_size = match projector {
            Projector::Qwen25Vl => 112,
            _ => 0,
        };
        Ok(Self {
            projector,
            n_embd,
            n_ff,
            n_layer,
            n_head,
            eps,
            image_size,
            patch_size,
            mean,
            std,
            n_merge,
            n_embd_out,
            ffn,
            min_pixels: u64::from(min_tokens) * patch_area,
            max_pixels: u64::from(max_tokens) * patch_area,
            longest_edge: opt_u32("clip.vision.preproc_image_size")?.unwrap_or(0).min(MAX_IMAGE_SIZE * 4),
            n_wa_pattern,
            window_size,
        })
    }

    /// The family's facts.
    pub fn traits(&self) -> ProjectorTraits {
        self.projector.traits()
    }

    /// Head width.
    pub fn head_dim(&self) -> u32 {
        self.n_embd / self.n_head
    }

    /// Patches per side of a square `image_size` input.
    pub fn patches_per_side(&self) -> u32 {
        self.image_size / self.patch_size
    }

    /// Embeddings the projector gives for an encoder input of `nx` x `ny` pixels.
    pub fn tokens_for(&self, nx: u32, ny: u32) -> u32 {
        let (cols, rows) = self.token_grid(nx, ny);
        cols * rows
    }

    /// The largest encoder input (width, height in pixels) an image can become: the family's
    /// square, or for dynamic sizes the most pixels `max_pixels` allows in whole merged patches
    /// (the squarest such rectangle); LFM2-VL's inputs are its tiles or a dynamic size, the
    /// larger. Memory and the NPU's batches are planned for it.
    pub fn largest_input(&self) -> (u32, u32) {
        let side = (self.image_size, self.image_size);
        let area = |(w, h): (u32, u32)| u64::from(w) * u64::from(h);
        let align = u64::from((self.patch_size * self.n_merge).max(1));
        let units = self.max_pixels / (align * align);
        // Every area up to `units` is a strip; the squarest rectangle of that area is the one
        // whose width is its largest divisor not above its square root.
        let w = (1..=units.isqrt()).rev().find(|w| units % w == 0).unwrap_or(1);
        let cap = |x: u64| u32::try_from(x * align).unwrap_or(u32::MAX);
        let dynamic = (cap(units / w), cap(w));
        match self.traits().layout {
            Layout::Dynamic if units > 0 => dynamic,
            Layout::SmartTiles => {
                let tile = (LFM2_TILE, LFM2_TILE);
                if units > 0 && area(dynamic) > area(tile) {
                    dynamic
                } else {
                    tile
                }
            }
            _ => side,
        }
    }

    /// The grid (columns, rows) of the embeddings the projector gives, in raster order, for an
    /// encoder input of `nx` x `ny` pixels.
    pub fn token_grid(&self, nx: u32, ny: u32) -> (u32, u32) {
        let (px, py) = (nx / self.patch_size, ny / self.patch_size);
        match self.traits().merge {
            // (The pixel shuffle pads the grid to whole squares, as clip.)
            Merge::ShuffleLinear | Merge::ShuffleMlp => {
                (px.div_ceil(self.n_merge), py.div_ceil(self.n_merge))
            }
            Merge::PoolNormProject | Merge::SpatialMlp => (px / self.n_merge, py / self.n_merge),
        }
    }
}

fn bad(key: &str, value: f64, problem: &'static str) -> ModelError {
    ModelError::BadHParam { key: name_of(key), value, problem }
}

/// Checks that every tensor the projector needs is present with the shape its hyper-parameters
/// imply and a type accepted for its role.
pub fn validate_vision_tensors(g: &Gguf<'_>, vp: &VisionParams) -> Result<(), ModelError> {
    use TensorKind::{Bias, Norm, Weight};
    let traits = vp.traits();
    let check = |name: core::fmt::Arguments<'_>, shape: &[u64], kind: TensorKind, required: bool| {
        let mut n = Name::new();
        let _ = n.write_fmt(name);
        let mut ne = [1u64; 4];
        ne[..shape.len()].copy_from_slice(shape);
        let Some(t) = g.tensor(&n) else {
            return if required { Err(ModelError::MissingTensor { name: n }) } else { Ok(()) };
        };
        if t.ne != ne {
            return Err(ModelError::TensorShape { name: n, expected: ne, found: t.ne });
        }
        if !kind.accepts(t.ty) {
            return Err(ModelError::TensorType { name: n, ty: t.ty, role: kind });
        }
        Ok(())
    };
    let (e, f, p, out) =
        (u64::from(vp.n_embd), u64::from(vp.n_ff), u64::from(vp.patch_size), u64::from(vp.n_embd_out));
    // The patch convolution's kernel [KW, KH, channels, n_embd]: as a matrix, a row of 3 p² taps
    // per output, in the order of the unfolded patch (channel, row, column).
    check(format_args!("v.patch_embd.weight"), &[p, p, 3, e], Weight, true)?;
    check(format_args!("v.patch_embd.weight.1"), &[p, p, 3, e], Weight, traits.two_patch_convs)?;
    check(format_args!("v.patch_embd.bias"), &[e], Bias, traits.patch_bias)?;
    match traits.positions {
        PatchPositions::Learned => {
            let n = u64::from(vp.patches_per_side()).pow(2);
            check(format_args!("v.position_embd.weight"), &[e, n], Norm, true)?;
        }
        PatchPositions::LearnedResized => {
            let n = g.tensor("v.position_embd.weight").map_or(1, |t| t.ne[1]);
            let side = libm::sqrt(n as f64) as u64;
            if side * side != n {
                return Err(ModelError::TensorShape {
                    name: name_of("v.position_embd.weight"),
                    expected: [e, side * side, 1, 1],
                    found: [e, n, 1, 1],
                });
            }
            check(format_args!("v.position_embd.weight"), &[e, n], Norm, true)?;
        }
        PatchPositions::Rope2d => {}
    }
    let layer_norm = traits.norm == VisionNorm::Layer;
    check(format_args!("v.pre_ln.weight"), &[e], Norm, false)?;
    check(format_args!("v.pre_ln.bias"), &[e], Bias, false)?;
    for i in 0..vp.n_layer {
        for m in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            check(format_args!("v.blk.{i}.{m}.weight"), &[e, e], Weight, true)?;
            check(format_args!("v.blk.{i}.{m}.bias"), &[e], Bias, false)?;
        }
        for n in ["ln1", "ln2"] {
            check(format_args!("v.blk.{i}.{n}.weight"), &[e], Norm, true)?;
            check(format_args!("v.blk.{i}.{n}.bias"), &[e], Bias, layer_norm)?;
        }
        let gated = g.tensor(&layer(i, "ffn_gate.weight")).is_some();
        if gated && vp.ffn != VisionFfn::Silu {
            return Err(bad("clip.use_silu", 0.0, "a gated ViT FFN (ffn_gate) needs clip.use_silu"));
        }
        check(format_args!("v.blk.{i}.ffn_gate.weight"), &[e, f], Weight, false)?;
        check(format_args!("v.blk.{i}.ffn_gate.bias"), &[f], Bias, false)?;
        check(format_args!("v.blk.{i}.ffn_up.weight"), &[e, f], Weight, true)?;
        check(format_args!("v.blk.{i}.ffn_up.bias"), &[f], Bias, false)?;
        check(format_args!("v.blk.{i}.ffn_down.weight"), &[f, e], Weight, true)?;
        check(format_args!("v.blk.{i}.ffn_down.bias"), &[e], Bias, false)?;
    }
    check(format_args!("v.post_ln.weight"), &[e], Norm, traits.merge == Merge::SpatialMlp)?;
    check(format_args!("v.post_ln.bias"), &[e], Bias, traits.merge == Merge::SpatialMlp && layer_norm)?;
    let s2 = u64::from(vp.n_merge).pow(2);
    match traits.merge {
        Merge::PoolNormProject => {
            check(format_args!("mm.soft_emb_norm.weight"), &[e], Norm, true)?;
            check(format_args!("mm.input_projection.weight"), &[out, e], Weight, true)?;
        }
        Merge::ShuffleLinear => check(format_args!("mm.model.fc.weight"), &[e * s2, out], Weight, true)?,
        Merge::ShuffleMlp => {
            check(format_args!("mm.input_norm.weight"), &[e * s2], Norm, false)?;
            check(format_args!("mm.input_norm.bias"), &[e * s2], Bias, false)?;
            let mid = g.tensor("mm.1.weight").map_or(out, |t| t.ne[1]);
            check(format_args!("mm.1.weight"), &[e * s2, mid], Weight, true)?;
            check(format_args!("mm.1.bias"), &[mid], Bias, false)?;
            check(format_args!("mm.2.weight"), &[mid, out], Weight, true)?;
            check(format_args!("mm.2.bias"), &[out], Bias, false)?;
        }
        Merge::SpatialMlp => {
            // (Released merger MLPs are e s² wide inside; the width is the file's.)
            let h = e * s2;
            let mid = g.tensor("mm.0.weight").map_or(h, |t| t.ne[1]);
            check(format_args!("mm.0.weight"), &[h, mid], Weight, true)?;
            check(format_args!("mm.0.bias"), &[mid], Bias, true)?;
            check(format_args!("mm.2.weight"), &[mid, out], Weight, true)?;
            check(format_args!("mm.2.bias"), &[out], Bias, true)?;
        }
    }
    Ok(())
}

fn layer(i: u32, name: &str) -> Name {
    let mut n = Name::new();
    let _ = write!(n, "v.blk.{i}.{name}");
    n
}

/// Opens a projector file: its keys and tensors checked.
pub fn check_projector(g: &Gguf<'_>) -> Result<VisionParams, ModelError> {
    let vp = VisionParams::read(g)?;
    validate_vision_tensors(g, &vp)?;
    Ok(vp)
}
