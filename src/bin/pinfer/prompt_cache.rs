//! `generate --prompt-cache FILE`: the KV cache of a processed prompt kept in a file (the
//! server's slot file format, `kv_file`) and reused when a later prompt starts with the same
//! tokens, as llama-cli's --prompt-cache. Whatever is wrong with the file (missing, truncated,
//! zero-filled, from another model or cache layout, a directory, an unwritable place) gives a
//! note on stderr and a normal run: a file is used only when it matches exactly.

use std::path::{Path, PathBuf};

use pinfer::session::Session;

use crate::kv_file::{self, Identity};

pub struct PromptCache {
    path: PathBuf,
    identity: Identity,
}

impl PromptCache {
    pub fn new(path: &Path, session: &Session) -> Self {
        Self { path: path.to_path_buf(), identity: Identity::of(session) }
    }

    fn note(&self, what: &str) {
        errln!("pinfer: prompt cache {}: {what}", self.path.display());
    }

    /// Loads the file into the (empty) cache and keeps the part shared with `prompt`, leaving
    /// at least the prompt's last token to evaluate (its logits are needed); the tokens kept,
    /// and the tokens the file shares with `prompt` (all of them: nothing new to save).
    pub fn restore(&self, session: &mut Session, prompt: &[u32]) -> (usize, usize) {
        if !self.path.exists() {
            self.note("not found: it will be written once the prompt is processed");
            return (0, 0);
        }
        let (tokens, rows) = match kv_file::read(&self.path, &self.identity, session.n_ctx()) {
            Ok(v) => v,
            Err(e) => {
                self.note(&format!("{e}; not used"));
                return (0, 0);
            }
        };
        let shared = tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = shared.min(prompt.len().saturating_sub(1));
        if keep == 0 {
            self.note("shares no prefix with this prompt; not used");
            return (0, 0);
        }
        if let Err(e) = session.restore_sequence(0, tokens.len(), &rows) {
            self.note(&format!("{e}; not used"));
            let _ = session.truncate(0);
            return (0, 0);
        }
        let keep = session.truncate(keep);
        if keep == 0 {
            // A model with recurrent layers reuses a saved prompt only whole.
            self.note("holds a longer prompt than the part this one shares, and this model's recurrent layers cannot be cut; not used");
            return (0, 0);
        }
        errln!(
            "pinfer: prompt cache {}: reused {keep} of the prompt's {} tokens",
            self.path.display(),
            prompt.len()
        );
        (keep, shared)
    }

    /// Writes the cache of the processed `prompt` (atomically: a failed write leaves the old
    /// file); a failure is a note.
    pub fn save(&self, session: &Session, prompt: &[u32]) {
        if !kv_file::replaceable(&self.path) {
            self.note("is not a pinfer prompt cache: not overwritten (give another file)");
            return;
        }
        let written = session
            .save_sequence(0, prompt.len())
            .map_err(|e| e.to_string())
            .and_then(|rows| kv_file::write(&self.path, &kv_file::encode(&self.identity, prompt, &rows)));
        match written {
            Ok(()) => errln!("pinfer: prompt cache {}: saved {} tokens", self.path.display(), prompt.len()),
            Err(e) => self.note(&format!("not written: {e}")),
        }
    }
}
