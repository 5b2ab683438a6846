//! Embeddings of many inputs (std): each input's tokens one sequence, sequences packed into
//! batches that fill the session's `-b` tokens and `n_seq` sequences, each batch one engine step
//! (an encoder keeps nothing between them), the vectors normalised as `--embd-normalize` says.
//! Inputs longer than one batch or the context are truncated or refused
//! ([`EmbedError::ExceedsContext`], llama.cpp's `exceed_context_size_error`). The CLI's `embed`
//! and `rerank` use it, and the server's embedding routes are to.

use std::fmt;
use std::vec;
use std::vec::Vec;

use crate::engine::embedding::{normalize, Normalize};
use crate::engine::Entry;
use crate::model::Pooling;
use crate::session::{Session, SessionError};

/// How inputs are embedded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbedOptions {
    /// How each vector is normalised (llama.cpp's default: Euclidean).
    pub normalize: Normalize,
    /// Cut an input longer than the limit to its first tokens (Ollama's `truncate: true`),
    /// instead of refusing it.
    pub truncate: bool,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self { normalize: Normalize::Euclidean, truncate: false }
    }
}

/// Why inputs could not be embedded.
#[derive(Debug)]
#[non_exhaustive]
pub enum EmbedError {
    /// The model gives no embeddings (a generating model): llama.cpp's refusal.
    NotAnEncoder,
    /// Input `index` has no tokens.
    Empty {
        /// Which input.
        index: usize,
    },
    /// Input `index` has more tokens than one batch or the context holds (truncation off).
    ExceedsContext {
        /// Which input.
        index: usize,
        /// Its tokens.
        tokens: usize,
        /// The most one input may have: the smaller of the context and the batch.
        limit: usize,
    },
    /// The engine refused a step.
    Session(SessionError),
}

impl fmt::Display for EmbedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAnEncoder => f.write_str(
                "this model does not support embeddings: it generates text (use an embedding model such as bert)",
            ),
            Self::Empty { index } => write!(f, "input {index} is empty"),
            Self::ExceedsContext { index, tokens, limit } => write!(
                f,
                "input {index} ({tokens} tokens) exceeds the available context size ({limit} tokens); \
                 raise -b / -c (up to the model's context) or truncate it"
            ),
            Self::Session(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for EmbedError {}

impl From<SessionError> for EmbedError {
    fn from(e: SessionError) -> Self {
        Self::Session(e)
    }
}

/// Every input's vectors: one row per input when the model pools, one per token with
/// `Pooling::None`, each [`Embeddings::width`] values, normalised.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// Values of one vector (`n_embd`, or a reranker's labels).
    pub width: usize,
    /// The pooling the vectors come from.
    pub pooling: Pooling,
    /// Per input, its rows one after another.
    pub rows: Vec<Vec<f32>>,
    /// Per input, the tokens evaluated (after truncation).
    pub tokens: Vec<usize>,
}

impl Embeddings {
    /// Input `i`'s `r`-th row.
    pub fn row(&self, i: usize, r: usize) -> Option<&[f32]> {
        self.rows.get(i)?.get(r * self.width..(r + 1) * self.width)
    }
}

/// The most tokens one input may have in `session`: one batch, within the context.
pub fn input_limit(session: &Session) -> usize {
    session.n_batch().min(session.n_ctx())
}

/// Embeds `inputs` (token ids each) in batches filling the session's batch and sequences.
pub fn embed(
    session: &mut Session,
    inputs: &[&[u32]],
    opts: &EmbedOptions,
) -> Result<Embeddings, EmbedError> {
    embed_typed(session, inputs, &[], opts)
}

/// [`embed`] with each input's token types (one per token: a BERT pair's `[CLS] q [SEP]` type 0,
/// `d [SEP]` type 1, from [`Tokenizer::encode_pair`](crate::tokenizer::Tokenizer::encode_pair));
/// `types` empty gives every token type 0 (llama.cpp's).
pub fn embed_typed(
    session: &mut Session,
    inputs: &[&[u32]],
    types: &[&[u32]],
    opts: &EmbedOptions,
) -> Result<Embeddings, EmbedError> {
    if !types.is_empty()
        && (types.len() != inputs.len() || types.iter().zip(inputs).any(|(t, i)| t.len() != i.len()))
    {
        return Err(EmbedError::Session(SessionError::Option(
            "token types must be given one per token of every input",
        )));
    }
    let Some(pooling) = session.engine().pooling() else { return Err(EmbedError::NotAnEncoder) };
    let limit = input_limit(session);
    let mut lengths = Vec::with_capacity(inputs.len());
    for (index, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(EmbedError::Empty { index });
        }
        if ids.len() > limit && !opts.truncate {
            return Err(EmbedError::ExceedsContext { index, tokens: ids.len(), limit });
        }
        lengths.push(ids.len().min(limit));
    }
    let (n_batch, n_seq) = (session.n_batch(), session.n_seq().min(session.n_outputs()));
    let mut out = Embeddings { width: 0, pooling, rows: vec![Vec::new(); inputs.len()], tokens: lengths };
    let mut batch: Vec<Entry> = Vec::with_capacity(n_batch);
    let mut batch_types: Vec<u32> = Vec::with_capacity(if types.is_empty() { 0 } else { n_batch });
    let mut first = 0;
    while first < inputs.len() {
        // As many whole inputs as fit one batch (and, per token, the outputs without pooling).
        batch.clear();
        batch_types.clear();
        let mut end = first;
        while end < inputs.len() && end - first < n_seq && batch.len() + out.tokens[end] <= n_batch {
            if !pooling.pools() && batch.len() + out.tokens[end] > session.n_outputs() {
                break;
            }
            let seq = end - first;
            let ids = &inputs[end][..out.tokens[end]];
            batch.extend(ids.iter().enumerate().map(|(pos, &token)| Entry { seq, pos, token, logits: true }));
            if let Some(t) = types.get(end) {
                batch_types.extend_from_slice(&t[..ids.len()]);
            }
            end += 1;
        }
        if end == first {
            return Err(EmbedError::Session(SessionError::Option(
                "the session's outputs cannot hold one input's token vectors (open it with logits_all)",
            )));
        }
        session.decode_typed(&batch, &batch_types)?;
        let engine = session.engine();
        out.width = engine.embedding_width();
        let mut row = 0;
        for (i, rows) in out.rows[first..end].iter_mut().enumerate() {
            let n = if pooling.pools() { 1 } else { out.tokens[first + i] };
            rows.resize(n * out.width, 0.0);
            for r in 0..n {
                let got = engine.embedding(row).ok_or(EmbedError::NotAnEncoder)?;
                normalize(got, &mut rows[r * out.width..(r + 1) * out.width], opts.normalize);
                row += 1;
            }
        }
        first = end;
    }
    Ok(out)
}

/// A reranker's prompt for a query and a document from the model's `rerank` template
/// (`tokenizer.chat_template.rerank`, Qwen3-Reranker's): `{query}` and `{document}` replaced, as
/// llama.cpp fills it; the text is tokenized with its special tokens parsed and nothing added.
pub fn rerank_prompt(template: &str, query: &str, document: &str) -> std::string::String {
    template.replace("{query}", query).replace("{document}", document)
}

/// The model's `rerank` prompt template, if its file has one.
pub fn rerank_template<'a>(gguf: &crate::gguf::Gguf<'a>) -> Option<&'a str> {
    gguf.get_str_opt("tokenizer.chat_template.rerank").ok().flatten()
}
