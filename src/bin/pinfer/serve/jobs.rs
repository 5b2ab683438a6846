//! Generations as jobs of the engine thread: submitted within the queue bound, their events
//! collected whole or streamed as a response body (SSE or NDJSON).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use pinfer::grammar::{Constraint, GrammarSpec, Vocab};

use super::api::ApiError;
use super::slots::{self, Event, GenParams, Job, Request as EngineRequest};
use super::{Ready, Shared};

/// A generation submitted to the engine: its events, and the bookkeeping of the queue bound.
pub struct Submitted {
    pub events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    shared: Arc<Shared>,
    pub n_prompt: usize,
}

impl Drop for Submitted {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Queues `prompt` for generation: 400 when it is empty or does not fit a slot's context, 503
/// when the queue is full or the server is stopping.
pub fn submit(shared: &Arc<Shared>, prompt: Vec<u32>, params: GenParams) -> Result<Submitted, ApiError> {
    let state = shared.state()?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    if prompt.len() >= state.ready.n_ctx {
        return Err(ApiError::exceeds_context(prompt.len(), state.ready.n_ctx));
    }
    if shared.stop.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let constraint = params.grammar.as_ref().map(|spec| compile(state.ready, spec)).transpose()?;
    let limit = state.opts.queue + state.ready.n_slots;
    if shared.in_flight.fetch_add(1, Ordering::Relaxed) >= limit {
        shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::unavailable("the server is busy: every slot is taken and the queue is full"));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let n_prompt = prompt.len();
    let submitted = Submitted { events: rx, shared: shared.clone(), n_prompt };
    state
        .ready
        .jobs
        .try_send(EngineRequest::Generate(Box::new(Job { prompt, params, constraint, events: tx })))
        .map_err(|_| ApiError::unavailable("the server is busy: the queue is full"))?;
    Ok(submitted)
}

/// A request's grammar compiled against the model's vocabulary: an invalid one is a 400.
fn compile(ready: &Ready, spec: &GrammarSpec) -> Result<Constraint, ApiError> {
    let vocab = match ready.vocab.get() {
        Some(v) => v,
        None => {
            let v = Vocab::new(&ready.tok).map_err(|e| ApiError::server(e.to_string()))?;
            ready.vocab.get_or_init(|| v)
        }
    };
    vocab.compile(spec).map_err(|e| ApiError::invalid(e.to_string()))
}

/// A whole generation, collected (non-streaming requests).
pub struct Collected {
    pub text: String,
    pub probs: Vec<slots::TokenProbs>,
    pub summary: slots::Summary,
}

/// Waits for the end of a submitted generation.
pub async fn collect(mut sub: Submitted) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut probs = Vec::new();
    while let Some(event) = sub.events.recv().await {
        match event {
            Event::Token { text: t, probs: p } => {
                text.push_str(&t);
                probs.extend(p);
            }
            Event::Done(summary) => return Ok(Collected { text, probs, summary }),
            Event::Failed(message) => return Err(ApiError::server(message)),
        }
    }
    Err(ApiError::server("the engine stopped"))
}

/// `finish_reason` of a stop: "stop" or "length".
pub fn finish_reason(stop: pinfer::generate::Stop) -> &'static str {
    use pinfer::generate::Stop;
    match stop {
        Stop::Limit | Stop::ContextFull => "length",
        Stop::EndOfGeneration | Stop::StopString | Stop::Cancelled | Stop::GrammarDeadEnd => "stop",
    }
}

/// Streams a generation's events as a response body (SSE or NDJSON): `render` turns each event
/// into the text to send (`None`: nothing). The stream ends after `Done` or `Failed`, or as soon as
/// the client leaves (the body dropped), which drops `sub` and so cancels the generation, even
/// while it waits in the queue or reads its prompt.
pub fn stream_events(
    mut sub: Submitted,
    content_type: &'static str,
    mut render: impl FnMut(Event) -> Option<String> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                e = sub.events.recv() => e,
                () = tx.closed() => None,
            };
            let Some(event) = event else { break };
            let last = matches!(event, Event::Done(_) | Event::Failed(_));
            if let Some(text) = render(event) {
                if tx.send(text).is_err() {
                    break;
                }
            }
            if last {
                break;
            }
        }
    });
    streaming(content_type, rx)
}

/// A streamed response body from a stream of text chunks (SSE or NDJSON).
/// A streamed response whose chunks are all known already (a reply sent whole once complete).
pub fn stream_of(content_type: &'static str, chunks: Vec<String>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for c in chunks {
        let _ = tx.send(c);
    }
    streaming(content_type, rx)
}

fn streaming(content_type: &'static str, rx: tokio::sync::mpsc::UnboundedReceiver<String>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::server("building the response").into_response())
}
