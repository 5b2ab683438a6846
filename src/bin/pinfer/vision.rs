//! `--mmproj` and `--image` for `generate`: the images encoded by the projector, the prompt and
//! the images made one user turn of the model's chat template (the media marker before the text
//! for each image the text does not place, as llama-mtmd-cli does), cut into the parts a session
//! is fed.

use std::path::Path;
use std::sync::Arc;

use pinfer::media::{parts, EncodedImage, Part, Projector, MEDIA_MARKER};
use pinfer::session::Session;
use pinfer::tokenizer::Tokenizer;
use serde_json::json;

use crate::gen_args::GenArgs;
use crate::CliError;

/// A prompt with its images, ready to feed.
pub struct ImagePrompt {
    /// The projector (kept for another turn's images).
    pub projector: Projector,
    /// The encoded images, in the prompt's order.
    pub images: Vec<Arc<EncodedImage>>,
    /// Text and image parts.
    pub parts: Vec<Part>,
    /// Time spent preprocessing and encoding the images.
    pub encode_time: std::time::Duration,
}

impl ImagePrompt {
    /// The text tokens of the prompt, in order.
    pub fn text_tokens(&self) -> Vec<u32> {
        self.parts
            .iter()
            .filter_map(|p| if let Part::Text(t) = p { Some(t.clone()) } else { None })
            .flatten()
            .collect()
    }

    /// Positions the prompt takes: its text tokens and every image's embeddings.
    pub fn positions(&self) -> usize {
        let n_embd = self.projector.params().n_embd_out as usize;
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.len(),
                Part::Image { image, input } => self.images[*image].inputs[*input].len() / n_embd,
            })
            .sum()
    }
}

/// Opens `--mmproj` for the session's model, encodes every `--image` and builds the prompt.
pub fn image_prompt(
    args: &GenArgs,
    session: &Session,
    tok: &Tokenizer<'_>,
    path: &Path,
    text: &str,
) -> Result<ImagePrompt, CliError> {
    let Some(mmproj) = &args.mmproj else {
        return Err(CliError::new(
            "--image needs the model's vision projector: give it with --mmproj FILE".into(),
        ));
    };
    let mut projector = Projector::open(mmproj, session).map_err(|e| CliError::new(e.to_string()))?;
    let mut images = Vec::with_capacity(args.image.len());
    let started = std::time::Instant::now();
    for file in &args.image {
        let bytes =
            std::fs::read(file).map_err(|e| CliError::new(format!("--image {}: {e}", file.display())))?;
        let image = projector
            .encode(&bytes, session.runner())
            .map_err(|e| CliError::new(format!("--image {}: {e}", file.display())))?;
        images.push(image);
    }
    let encode_time = started.elapsed();
    let mut content = text.to_string();
    if !content.contains(MEDIA_MARKER) {
        content = MEDIA_MARKER.repeat(images.len()) + &content;
    }
    let format = crate::chat::prompt_format(args, session.gguf(), tok, path)?;
    let kwargs = crate::chat::template_kwargs(args)?;
    let messages = match &args.system {
        Some(system) => json!([{"role": "system", "content": system}, {"role": "user", "content": content}]),
        None => json!([{"role": "user", "content": content}]),
    };
    let formatted =
        format.render(&messages, None, true, Some(&kwargs)).map_err(|e| CliError::new(e.to_string()))?;
    let wrap = projector.params().traits().wrap;
    let parts = parts(tok, wrap, &formatted, &images, true).map_err(|e| CliError::new(e.to_string()))?;
    Ok(ImagePrompt { projector, images, parts, encode_time })
}
