//! Images in `pinfer chat` (`--mmproj`, `--image`, `/image PATH`), as llama-mtmd-cli's chat takes
//! them.

use std::path::Path;
use std::sync::Arc;

use pinfer::media::{parts, EncodedImage, Projector, MEDIA_MARKER};
use pinfer::session::Session;
use pinfer::tokenizer::Tokenizer;

use crate::CliError;

/// Images in `pinfer chat` (llama-mtmd-cli's chat): `--image` files and `/image PATH` lines are
/// encoded at once and go with the next user message (a media marker before its text for each
/// one it does not place). Each turn feeds what the conversation's rendering adds to the text fed
/// so far (the reply's own tokens are in the cache already); when a template renders the past
/// otherwise, the whole conversation is fed again (its images from the projector's cache).
pub struct ChatMedia {
    projector: Projector,
    /// Images of the next user message.
    pending: Vec<Arc<EncodedImage>>,
    /// Every image of the conversation, in the order of its markers.
    all: Vec<Arc<EncodedImage>>,
    /// The rendered text the cache holds (with the images' markers), replies included.
    fed: String,
}

impl ChatMedia {
    /// Opens `--mmproj` for the session's model.
    pub fn open(session: &Session, mmproj: &Path) -> Result<Self, CliError> {
        let projector = Projector::open(mmproj, session).map_err(|e| CliError::new(e.to_string()))?;
        Ok(Self { projector, pending: Vec::new(), all: Vec::new(), fed: String::new() })
    }

    /// Decodes and encodes the image in `file` for the next user message; returns its positions.
    pub fn attach(&mut self, session: &Session, file: &Path) -> Result<usize, CliError> {
        let bytes =
            std::fs::read(file).map_err(|e| CliError::new(format!("image {}: {e}", file.display())))?;
        let image = self
            .projector
            .encode(&bytes, session.runner())
            .map_err(|e| CliError::new(format!("image {}: {e}", file.display())))?;
        let n = image.n_tokens(self.projector.params().n_embd_out as usize);
        self.pending.push(image);
        Ok(n)
    }

    /// The user's message with a marker for each pending image it does not place; the images
    /// become the conversation's.
    pub fn message(&mut self, text: &str) -> String {
        let placed = text.matches(MEDIA_MARKER).count();
        let missing = self.pending.len().saturating_sub(placed);
        self.all.append(&mut self.pending);
        MEDIA_MARKER.repeat(missing) + text
    }

    /// Feeds the conversation `rendered` (with the generation prompt) after what the cache
    /// holds: the new part only when `rendered` goes on from the text fed so far, else all of it
    /// from an empty cache. Appends the text tokens fed to `history` (the sampler's).
    pub fn feed_turn(
        &mut self,
        session: &mut Session,
        tok: &Tokenizer<'_>,
        rendered: &str,
        history: &mut Vec<u32>,
    ) -> Result<(), CliError> {
        let wrap = self.projector.params().traits().wrap;
        let continues = !self.fed.is_empty() && rendered.starts_with(&self.fed);
        let (text, images, first) = if continues {
            let new = &rendered[self.fed.len()..];
            let n_new = new.matches(MEDIA_MARKER).count();
            (new, &self.all[self.all.len().saturating_sub(n_new)..], false)
        } else {
            let _ = session.truncate(0);
            history.clear();
            (rendered, &self.all[..], true)
        };
        let parts = parts(tok, wrap, text, images, first).map_err(|e| CliError::new(e.to_string()))?;
        let fed = pinfer::media::feed(session, self.projector.params(), &parts, images);
        history.extend(fed.map_err(|e| CliError::new(e.to_string()))?);
        self.fed = rendered.to_string();
        Ok(())
    }

    /// Notes the reply's tokens the cache holds (the ones evaluated of `reply`) as fed text.
    pub fn replied(&mut self, tok: &Tokenizer<'_>, reply: &[u32]) {
        let mut buf = vec![0u8; tok.max_piece_len() + 8];
        let mut bytes = Vec::new();
        for &id in reply {
            let n = tok.token_to_piece(id, false, &mut buf).unwrap_or(0);
            bytes.extend_from_slice(&buf[..n]);
        }
        // (Invalid UTF-8 cannot match a rendering: the next turn then feeds everything again.)
        self.fed.push_str(&String::from_utf8_lossy(&bytes));
    }
}
