//! std: prompts with images, as libmtmd builds them. A projector file (mmproj) is opened beside
//! the model and checked against it; each image is decoded, preprocessed and encoded once (kept by
//! its bytes, so a later turn about the same image is not encoded again); the prompt text is cut
//! at the media marker and every image put in its place with its family's wrapper tokens
//! ([`Wrap`]); then the parts are fed to a session: text as tokens, images as embeddings.

use std::collections::hash_map::DefaultHasher;
use std::fmt;
use std::format;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::string::{String, ToString};
use std::sync::Arc;
use std::vec;
use std::vec::Vec;

use crate::engine::vision::{VisionMemory, VisionPacking, VisionPlanned};
use crate::engine::{GraphSlot, Runner};
use crate::image::{decode, preprocess, ImageError, ImageLimits};
use crate::loader::ModelFile;
use crate::model::vision::{check_projector, Projector as Family, VisionParams, Wrap};
use crate::model::Arch;
use crate::session::{Session, SessionError};
use crate::tokenizer::Tokenizer;

/// Where a prompt's text puts an image (libmtmd's default marker).
pub const MEDIA_MARKER: &str = "<__media__>";

/// Images kept encoded per projector (a conversation's few; the oldest is dropped first).
const KEPT_IMAGES: usize = 8;

/// Why an image or a projector cannot be used.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaError {
    /// The projector file.
    Projector(String),
    /// The image.
    Image(ImageError),
    /// Running the encoder.
    Encode(String),
    /// The prompt and the images do not go together.
    Prompt(String),
}

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Projector(m) | Self::Encode(m) | Self::Prompt(m) => f.write_str(m),
            Self::Image(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for MediaError {}

impl From<ImageError> for MediaError {
    fn from(e: ImageError) -> Self {
        Self::Image(e)
    }
}

/// An encoded image: its embeddings per encoder input (tiles, then the whole image, for the tiled
/// families), in the order the text takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedImage {
    /// Embeddings of each encoder input, `n_embd` values per token.
    pub inputs: Vec<Vec<f32>>,
    /// The token grid (columns, rows) of each encoder input, in raster order (an M-RoPE model
    /// turns an image's tokens by their row and column).
    pub token_grids: Vec<(usize, usize)>,
    /// Tiles per row and column (1 x 1 for one input).
    pub grid: (u32, u32),
    /// Whether the last input is the whole image beside the tiles.
    pub overview: bool,
}

impl EncodedImage {
    /// Positions the image takes in the text (its embeddings; the wrapper tokens aside).
    pub fn n_tokens(&self, n_embd: usize) -> usize {
        self.inputs.iter().map(|e| e.len() / n_embd.max(1)).sum()
    }
}

/// An image decoded (its size checked) and the key it is kept by: a request's image, ready for a
/// projector.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedImage {
    /// The image's bytes, hashed with their length.
    pub key: (u64, usize),
    /// Its pixels.
    pub rgb: Arc<crate::image::Rgb8>,
}

impl DecodedImage {
    /// Decodes `bytes` within `limits`.
    pub fn decode(bytes: &[u8], limits: ImageLimits) -> Result<Self, MediaError> {
        let mut h = DefaultHasher::new();
        bytes.hash(&mut h);
        Ok(Self { key: (h.finish(), bytes.len()), rgb: Arc::new(decode(bytes, limits)?) })
    }
}

/// Decodes standard base64 (RFC 4648: `+` and `/`, `=` padding optional; ASCII white space
/// skipped, as in wrapped MIME text). The error names the first bad character's offset.
pub fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(text.len() / 4 * 3 + 3);
    let (mut acc, mut bits, mut padding) = (0u32, 0u32, 0usize);
    for (i, &c) in text.as_bytes().iter().enumerate() {
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => continue,
            b'=' => {
                padding += 1;
                continue;
            }
            _ => {}
        }
        let v = value(c).filter(|_| padding == 0).ok_or_else(|| format!("invalid base64 at byte {i}"))?;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if bits >= 6 || padding > 2 {
        return Err("truncated base64".to_string());
    }
    Ok(out)
}

/// A projector opened beside a model: its file, its parameters, its graph and memory, the
/// images it encoded.
pub struct Projector {
    file: &'static ModelFile,
    params: VisionParams,
    slots: Vec<GraphSlot>,
    /// The matrices repacked for the packed kernels, once for every image (see
    /// [`VisionPacking`]), in `packed` from byte `packed_at` (aligned).
    packing: VisionPacking,
    packed: Vec<u8>,
    packed_at: usize,
    memory: Vec<u8>,
    kept: Vec<(u64, usize, Arc<EncodedImage>)>,
    limits: ImageLimits,
    /// The encoder's matmuls on the NPU (planned over its graph at the largest input).
    #[cfg(feature = "npu")]
    npu: Option<std::boxed::Box<crate::npu::NpuBackend>>,
}

impl fmt::Debug for Projector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Projector({}, {:?})", self.file.path().display(), self.params.projector)
    }
}

/// The language-model architectures each projector family feeds.
fn takes(family: Family, arch: Arch) -> bool {
    match family {
        Family::Gemma3 => arch == Arch::Gemma3,
        Family::Idefics3 => arch == Arch::Llama,
        Family::Lfm2 => arch == Arch::Lfm2,
        // (Qwen2-VL's language model places image tokens by M-RoPE: its qwen2vl architecture.)
        Family::Qwen2Vl | Family::Qwen25Vl => arch == Arch::Qwen2Vl,
    }
}

/// The memory the projector in `path` takes beside its model ([`VisionMemory`], planned at its
/// largest input): what a session's memory plan counts ([`crate::session::SessionOptions::projector`])
/// before anything loads. Refuses a file [`Projector::open`] would, with the same words.
pub fn projector_memory(path: &Path) -> Result<VisionMemory, MediaError> {
    let what = |e: &dyn fmt::Display| MediaError::Projector(format!("--mmproj {}: {e}", path.display()));
    let file = ModelFile::open(path).map_err(|e| what(&e))?;
    let mut slots = crate::engine::heap::slots(1).map_err(|e| what(&e))?;
    let planned = VisionPlanned::largest(file.bytes(), &mut slots[0]).map_err(|e| what(&e))?;
    planned.memory().map_err(|e| what(&e))
}

impl Projector {
    /// Opens and checks `path` (an mmproj file) for `session`'s model: its output width must be
    /// the model's embedding width and its family one the model's architecture takes. With the
    /// NPU on in the session (feature `npu`), the encoder's qualifying matmuls go there as the
    /// model's do (planned over its graph at the largest input; batches up to the session's).
    pub fn open(path: &Path, session: &Session) -> Result<Self, MediaError> {
        let hp = session.hparams();
        let what = |e: &dyn fmt::Display| MediaError::Projector(format!("--mmproj {}: {e}", path.display()));
        let file = ModelFile::open_static(path).map_err(|e| what(&e))?;
        let gguf = file.parse().map_err(|e| what(&e))?;
        let params = check_projector(&gguf).map_err(|e| what(&e))?;
        if params.n_embd_out != hp.n_embd {
            return Err(what(&format_args!(
                "the projector gives embeddings of {} values and the model's are {}: it belongs to another model",
                params.n_embd_out, hp.n_embd
            )));
        }
        if !takes(params.projector, hp.arch) {
            return Err(what(&format_args!(
                "a {} projector feeds another language model than this {} one",
                params.projector.name(),
                hp.arch.name()
            )));
        }
        let mut slots = crate::engine::heap::slots(1).map_err(|e| what(&e))?;
        // The matrices the encoder multiplies by, repacked once (a plan of any size reads the
        // same ones), and the NPU's matmuls: planned at the largest input, whose batches are
        // the largest.
        let planned = VisionPlanned::largest(file.bytes(), &mut slots[0]).map_err(|e| what(&e))?;
        #[cfg(feature = "npu")]
        let npu = {
            // (The encoder runs on the session's pool: the same cores drive NPU cores 1 and 2.)
            let rows = planned.params().largest_input();
            let p = planned.params().patch_size.max(1);
            let tokens = (rows.0 / p) as usize * (rows.1 / p) as usize;
            let n_batch = tokens.min(session.n_batch()).max(1);
            let graphs = [planned.graph()];
            crate::npu::session_backend(file, &graphs, session.npu_config(), n_batch, false)
                .map(std::boxed::Box::new)
        };
        let packing = planned.packing().map_err(|e| what(&e))?;
        let mut packed = Vec::new();
        let bytes = packing.bytes() + crate::arena::ARENA_ALIGN;
        packed
            .try_reserve_exact(bytes)
            .map_err(|_| what(&format_args!("cannot allocate {bytes} bytes for the repacked matrices")))?;
        packed.resize(bytes, 0);
        let packed_at = packed.as_ptr().align_offset(crate::arena::ARENA_ALIGN);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let buffer = &mut packed[packed_at..packed_at + packing.bytes()];
        planned.repack(&packing, buffer, &crate::session::Threads(threads)).map_err(|e| what(&e))?;
        drop(planned);
        Ok(Self {
            file,
            params,
            slots,
            packing,
            packed,
            packed_at,
            memory: Vec::new(),
            kept: Vec::new(),
            limits: ImageLimits::default(),
            #[cfg(feature = "npu")]
            npu,
        })
    }

    /// The encoder's NPU backend, when its matmuls go to the NPU (feature `npu`).
    #[cfg(feature = "npu")]
    pub fn npu(&self) -> Option<&crate::npu::NpuBackend> {
        self.npu.as_deref()
    }

    /// The projector's parameters.
    pub fn params(&self) -> &VisionParams {
        &self.params
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Decodes, preprocesses and encodes the image in `bytes` (or returns it as encoded before).
    pub fn encode(&mut self, bytes: &[u8], runner: &impl Runner) -> Result<Arc<EncodedImage>, MediaError> {
        let image = DecodedImage::decode(bytes, self.limits)?;
        self.encode_decoded(&image, runner)
    }

    /// Preprocesses and encodes a decoded image (or returns it as encoded before, by its key).
    pub fn encode_decoded(
        &mut self,
        image: &DecodedImage,
        runner: &impl Runner,
    ) -> Result<Arc<EncodedImage>, MediaError> {
        let key = image.key;
        if let Some(i) = self.kept.iter().position(|k| (k.0, k.1) == key) {
            let hit = self.kept.remove(i);
            let image = hit.2.clone();
            self.kept.push(hit);
            return Ok(image);
        }
        let pre = preprocess(&image.rgb, &self.params)?;
        let mut inputs = Vec::with_capacity(pre.images.len());
        let mut token_grids = Vec::with_capacity(pre.images.len());
        for input in &pre.images {
            let (w, h) = (input.width as usize, input.height as usize);
            let planned = VisionPlanned::new(self.file.bytes(), &mut self.slots[0], w, h)
                .map_err(|e| MediaError::Encode(format!("planning the image encoder: {e}")))?;
            let needed = planned.bytes_needed();
            if self.memory.len() < needed {
                self.memory.clear();
                self.memory.try_reserve_exact(needed).map_err(|_| {
                    MediaError::Encode(format!("cannot allocate {needed} bytes for the image encoder"))
                })?;
                self.memory.resize(needed, 0);
            }
            let mut engine = planned
                .bind(&mut self.memory[..])
                .map_err(|e| MediaError::Encode(format!("binding the image encoder: {e}")))?;
            let packed = (&self.packed[self.packed_at..self.packed_at + self.packing.bytes()], &self.packing);
            #[cfg(feature = "npu")]
            let offload = self.npu.as_deref().map(|n| n as &dyn crate::exec::MatmulOffload);
            #[cfg(not(feature = "npu"))]
            let offload = None;
            let rows = engine
                .encode_packed(&input.pixels, w, h, Some(packed), offload, runner)
                .map_err(|e| MediaError::Encode(format!("encoding the image: {e}")))?;
            inputs.push(rows.to_vec());
            let (cols, rows) = self.params.token_grid(input.width, input.height);
            token_grids.push((cols as usize, rows as usize));
        }
        let image = Arc::new(EncodedImage { inputs, token_grids, grid: pre.grid, overview: pre.overview });
        if self.kept.len() == KEPT_IMAGES {
            self.kept.remove(0);
        }
        self.kept.push((key.0, key.1, image.clone()));
        Ok(image)
    }
}

/// A part of a prompt: tokens, or one encoder input of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Token ids.
    Text(Vec<u32>),
    /// Image `image`'s encoder input `input`.
    Image {
        /// Index into the images.
        image: usize,
        /// Index into its inputs.
        input: usize,
    },
}

/// The token whose piece is exactly `text` (libmtmd's lookup: the first id), if any.
fn lookup(tok: &Tokenizer<'_>, text: &str) -> Option<u32> {
    let mut buf = vec![0u8; tok.max_piece_len().max(text.len()) + 8];
    (0..tok.n_vocab())
        .find(|&id| tok.token_to_piece(id, true, &mut buf).is_ok_and(|n| &buf[..n] == text.as_bytes()))
}

/// Builds the prompt's parts as libmtmd's tokenizer does: `text` cut at every [`MEDIA_MARKER`]
/// (as many as `images`), each segment tokenized with special tokens parsed and no BOS, each
/// image wrapped by its family's tokens, BOS first when `add_bos` and the model adds one.
pub fn parts(
    tok: &Tokenizer<'_>,
    wrap: Wrap,
    text: &str,
    images: &[Arc<EncodedImage>],
    add_bos: bool,
) -> Result<Vec<Part>, MediaError> {
    let segments: Vec<&str> = text.split(MEDIA_MARKER).collect();
    if segments.len() - 1 != images.len() {
        return Err(MediaError::Prompt(format!(
            "the prompt has {} image markers ({MEDIA_MARKER}) and {} images were given",
            segments.len() - 1,
            images.len()
        )));
    }
    let mut out: Vec<Part> = Vec::new();
    let text_part = |out: &mut Vec<Part>, ids: Vec<u32>| {
        if ids.is_empty() {
            return;
        }
        match out.last_mut() {
            Some(Part::Text(t)) => t.extend(ids),
            _ => out.push(Part::Text(ids)),
        }
    };
    let encode = |s: &str| -> Result<Vec<u32>, MediaError> {
        tok.encode_to_vec(s, true, false)
            .map_err(|e| MediaError::Prompt(format!("tokenizing the prompt: {e}")))
    };
    let token = |s: &str| -> Result<Vec<u32>, MediaError> {
        lookup(tok, s).map(|id| vec![id]).ok_or_else(|| {
            MediaError::Prompt(format!("the model's vocabulary has no {s:?} token, which its images need"))
        })
    };
    for (i, segment) in segments.iter().enumerate() {
        text_part(&mut out, encode(segment)?);
        let Some(image) = images.get(i) else { break };
        match wrap {
            Wrap::Gemma3 | Wrap::Qwen => {
                let (beg, end) = if wrap == Wrap::Gemma3 {
                    ("<start_of_image>", "<end_of_image>")
                } else {
                    ("<|vision_start|>", "<|vision_end|>")
                };
                text_part(&mut out, encode(beg)?);
                for input in 0..image.inputs.len() {
                    out.push(Part::Image { image: i, input });
                }
                text_part(&mut out, encode(end)?);
            }
            Wrap::Idefics3 => {
                let (cols, rows) = image.grid;
                for y in 0..rows as usize {
                    for x in 0..cols as usize {
                        text_part(
                            &mut out,
                            encode(&format!("<fake_token_around_image><row_{}_col_{}>", y + 1, x + 1))?,
                        );
                        out.push(Part::Image { image: i, input: y * cols as usize + x });
                    }
                    if y + 1 != rows as usize {
                        text_part(&mut out, token("\n")?);
                    }
                }
                if image.overview {
                    let mut start = token("\n\n")?;
                    start.extend(token("<fake_token_around_image>")?);
                    start.extend(token("<global-img>")?);
                    text_part(&mut out, start);
                    out.push(Part::Image { image: i, input: image.inputs.len() - 1 });
                    text_part(&mut out, token("<fake_token_around_image>")?);
                }
            }
            Wrap::Lfm2 => {
                // <|image_start|>, then either the image, or each tile after its
                // <|img_row_R_col_C|> and the thumbnail after <|img_thumbnail|>; <|image_end|>.
                text_part(&mut out, encode("<|image_start|>")?);
                if image.overview {
                    let (cols, rows) = image.grid;
                    for y in 0..rows as usize {
                        for x in 0..cols as usize {
                            text_part(&mut out, encode(&format!("<|img_row_{}_col_{}|>", y + 1, x + 1))?);
                            out.push(Part::Image { image: i, input: y * cols as usize + x });
                        }
                    }
                    text_part(&mut out, token("<|img_thumbnail|>")?);
                    out.push(Part::Image { image: i, input: image.inputs.len() - 1 });
                } else {
                    for input in 0..image.inputs.len() {
                        out.push(Part::Image { image: i, input });
                    }
                }
                text_part(&mut out, encode("<|image_end|>")?);
            }
        }
    }
    if add_bos && tok.add_bos() {
        if let Some(bos) = tok.bos() {
            match out.first_mut() {
                Some(Part::Text(t)) => t.insert(0, bos),
                _ => out.insert(0, Part::Text(vec![bos])),
            }
        }
    }
    Ok(out)
}

/// Feeds `parts` to sequence 0 of `session` after what it holds: text as tokens, images as
/// embeddings (attending both ways within each when the family says so); the last part's logits
/// are the session's after it. Returns the text tokens in order (a sampler's history).
pub fn feed(
    session: &mut Session,
    params: &VisionParams,
    parts: &[Part],
    images: &[Arc<EncodedImage>],
) -> Result<Vec<u32>, SessionError> {
    let causal = !params.traits().bidirectional_image;
    let mut text = Vec::new();
    for part in parts {
        match part {
            Part::Text(ids) => {
                session.eval(ids)?;
                text.extend_from_slice(ids);
            }
            Part::Image { image, input } => {
                let image = &images[*image];
                session.decode_embeddings(
                    0,
                    &image.inputs[*input],
                    causal,
                    image.token_grids.get(*input).copied(),
                )?;
            }
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::base64_decode;

    #[test]
    fn base64_decodes_padded_unpadded_wrapped_and_url_safe_text_and_refuses_the_rest() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVs\r\nbG8h").unwrap(), b"hell\x6f!");
        assert_eq!(base64_decode("").unwrap(), b"");
        assert_eq!(base64_decode("/+8=").unwrap(), base64_decode("_-8").unwrap());
        assert_eq!(base64_decode("AAECAwQFBgc=").unwrap(), [0, 1, 2, 3, 4, 5, 6, 7]);
        for bad in ["aGVsbG8%", "a", "aGVsb", "aG=Vs", "aGVsbG8===", "é"] {
            assert!(base64_decode(bad).is_err(), "{bad:?} accepted");
        }
    }
}
