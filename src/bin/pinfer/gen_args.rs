//! The options of `generate`, `chat` and `serve` (llama-cli's flags, [`GenArgs`]), checked before
//! the model loads, and the set-up they describe: sampler, session, model and tokenizer, speculation.

use std::path::PathBuf;

use clap::Args;
use pinfer::generate::Generator;
use pinfer::sampler::SamplerConfig;
use pinfer::session::{Session, SessionOptions};
use pinfer::speculative::{check_draft, DraftModel, Drafter, MOST_GUESSES};
use pinfer::tokenizer::{OwnedTokenizer, Tokenizer};

use crate::grammar_args::GrammarArgs;
use crate::runtime::{Runtime, RuntimeArgs};
use crate::text_input::{process_escapes, read_stdin, read_text_file};
use crate::tokenize::tokenizer;
use crate::CliError;

/// Options of `generate` and `chat`, spelled as llama-cli spells them.
#[derive(Args, Debug, Clone)]
pub struct GenArgs {
    /// Model file (GGUF). Default: the model fetched by scripts/setup.sh.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The prompt (`-`: read it from stdin). Special-token text such as <|im_start|> becomes the
    /// special token. In a conversation: the first user message.
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Vision projector (an mmproj GGUF, as llama.cpp's `--mmproj`): lets --image put images in
    /// the prompt.
    #[arg(long = "mmproj", value_name = "FILE")]
    pub mmproj: Option<PathBuf>,
    /// An image (JPEG, PNG, GIF, BMP, PNM, TGA) for the prompt, where it says <__media__> (else
    /// before the text), with the model's chat template around it as one user turn, as
    /// llama-mtmd-cli does. Repeatable; needs --mmproj.
    #[arg(long = "image", value_name = "FILE")]
    pub image: Vec<PathBuf>,
    /// Read the prompt from this file (`-`: stdin).
    #[arg(short = 'f', long = "file", value_name = "FILE", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// System message (conversation mode).
    #[arg(long = "system", visible_alias = "system-prompt", value_name = "TEXT", allow_hyphen_values = true)]
    pub system: Option<String>,
    /// Process escapes (\n, \r, \t, \', \", \\, \xNN) in the prompt and system message: on by
    /// default, as in llama-cli.
    #[arg(short = 'e', long = "escape", overrides_with = "no_escape")]
    pub escape: bool,
    /// Take the prompt's backslashes literally.
    #[arg(long = "no-escape")]
    pub no_escape: bool,
    /// Tokens to generate (-1: until end of generation or a full context; -2: until the context is full).
    #[arg(short = 'n', long = "n-predict", allow_negative_numbers = true)]
    pub n_predict: Option<i64>,
    /// Temperature (0: greedy).
    #[arg(long = "temp", default_value_t = 0.8, allow_negative_numbers = true)]
    pub temp: f32,
    /// Keep the K most likely tokens (0: all).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: u32,
    /// Keep the most likely tokens up to this total probability (1: all).
    #[arg(long = "top-p", default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long = "min-p", default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalty for repeating the last --repeat-last-n tokens (1: off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// Tokens the repeat penalty looks back on.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: u32,
    /// Subtracted from a token's logit per occurrence in the last --repeat-last-n tokens (0: off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token in the last --repeat-last-n tokens (0: off).
    #[arg(long = "presence-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Random seed (-1: a random one, printed with -v).
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    /// Context size in tokens (0: min(4096, the model's maximum)).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx: usize,
    /// Logical batch: most prompt tokens per evaluation (with -ub, the smaller counts).
    #[arg(short = 'b', long = "batch-size")]
    pub batch: Option<usize>,
    /// Physical batch (llama.cpp's -ub): most prompt tokens per graph evaluation.
    #[arg(long = "ubatch-size", value_name = "N")]
    pub ubatch: Option<usize>,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    #[command(flatten)]
    pub grammar: GrammarArgs,
    /// Draft-free speculative decoding: guess up to N tokens from earlier in the text (prompt
    /// lookup) and verify them in one batch; the output is the same as without it (serve: for
    /// every request).
    #[arg(long = "lookup", value_name = "N", conflicts_with = "model_draft")]
    pub lookup: Option<usize>,
    /// Speculative decoding with a draft model (`-md`): a small model of the same vocabulary guesses up to
    /// --draft-max tokens, verified in one batch; the output is the same as without it.
    #[arg(long = "model-draft", value_name = "FILE")]
    pub model_draft: Option<PathBuf>,
    /// Most tokens the draft model guesses per batch (llama.cpp's --draft-max).
    #[arg(
        long = "draft-max",
        visible_alias = "draft",
        alias = "draft-n",
        default_value_t = 16,
        value_name = "N"
    )]
    pub draft_max: usize,
    /// The draft model stops guessing when its next token is less likely than this.
    #[arg(long = "draft-p-min", default_value_t = 0.75, value_name = "P")]
    pub draft_p_min: f32,
    /// When the context is full, drop half of what follows the first --keep tokens and go on
    /// (llama.cpp's context shift); without it generation ends there.
    #[arg(long = "context-shift", overrides_with = "no_context_shift")]
    pub context_shift: bool,
    /// End generation when the context is full (the default).
    #[arg(long = "no-context-shift")]
    pub no_context_shift: bool,
    /// Prompt tokens a context shift always keeps (besides BOS); -1: the whole prompt.
    #[arg(long = "keep", default_value_t = 0, allow_negative_numbers = true, value_name = "N")]
    pub keep: i64,
    /// Stop generating when this text appears (it is not printed); may be given several times.
    #[arg(short = 'r', long = "reverse-prompt", value_name = "TEXT", allow_hyphen_values = true)]
    pub reverse_prompt: Vec<String>,
    /// Chat with the model's chat template (llama-cli's -cnv); `-i` is the same.
    #[arg(short = 'i', long = "conversation", visible_alias = "interactive")]
    pub conversation: bool,
    /// Plain completion even where llama-cli would start a conversation (accepted; the default).
    #[arg(long = "no-conversation", hide = true)]
    pub no_conversation: bool,
    /// Chat template: a built-in name (chatml, llama3, gemma, phi3, phi4, llama2, mistral-v7, ...) or
    /// a Jinja template text (default: the model's own).
    #[arg(long = "chat-template", value_name = "NAME|JINJA", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// Chat template: the Jinja template in FILE in place of the model's.
    #[arg(long = "chat-template-file", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Run the chat template's Jinja (the default, as llama.cpp's current --jinja; accepted).
    #[arg(long = "jinja", overrides_with = "no_jinja")]
    pub jinja: bool,
    /// Never run the chat template: recognise it by its markers and use a built-in format.
    #[arg(long = "no-jinja", overrides_with = "jinja")]
    pub no_jinja: bool,
    /// Extra variables for the chat template, a JSON object, e.g. '{"enable_thinking": false}'
    /// (a server request's `chat_template_kwargs` add to these).
    #[arg(long = "chat-template-kwargs", value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// A thinking model's reasoning: `auto` or `deepseek` split it out of the reply (the server's
    /// `reasoning_content`, Ollama's `thinking`), `none` leaves it in the text (llama.cpp's values).
    #[arg(long = "reasoning-format", value_name = "FORMAT", default_value = "auto",
          value_parser = ["auto", "deepseek", "none"])]
    pub reasoning_format: String,
    /// Thinking allowed: -1 unlimited, 0 turns it off through the template's own switch
    /// (`enable_thinking: false`), as llama.cpp's --reasoning-budget.
    #[arg(long = "reasoning-budget", value_name = "N", default_value_t = -1, allow_hyphen_values = true,
          value_parser = clap::value_parser!(i64).range(-1..=0))]
    pub reasoning_budget: i64,
    /// Colour the prompt apart from the generated text (ANSI).
    #[arg(long = "color", visible_alias = "colour")]
    pub color: bool,
    /// Do not echo the prompt: stdout holds only the generated text.
    #[arg(long = "no-display-prompt")]
    pub no_display_prompt: bool,
    /// Keep the KV cache of the processed prompt in FILE and reuse it when a later prompt starts
    /// with the same tokens (llama-cli's --prompt-cache). A file that does not match this model
    /// and cache, or is damaged, is ignored with a note.
    #[arg(long = "prompt-cache", value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
    /// Use the --prompt-cache file but never write it.
    #[arg(long = "prompt-cache-ro", requires = "prompt_cache")]
    pub prompt_cache_ro: bool,
    /// Print the generated token ids, space-separated, on the last line.
    #[arg(long = "print-ids")]
    pub print_ids: bool,
    /// Treat special-token text in the prompt as plain text.
    #[arg(long = "no-parse-special")]
    pub no_parse_special: bool,
    /// Keep generating past end-of-generation tokens (benchmarks).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Keep the file's weight layouts instead of repacking them (A/B comparisons; also
    /// PINFER_NO_REPACK=1).
    #[arg(long = "no-repack")]
    pub no_repack: bool,
    /// Print load details on stderr before the first token: board, workers and their cores,
    /// scheduling, memory plan, placement summary, kernels, seed (-vv: every tensor's placement).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    pub verbose: u8,
}

impl GenArgs {
    /// The sampler settings, checked (before the model loads); the seed drawn when -1.
    pub(crate) fn sampler(&self) -> Result<SamplerConfig, CliError> {
        let seed = match self.seed {
            -1 => random_seed(),
            s if s < 0 => {
                return Err(CliError::new(format!("--seed {s}: give 0 or more, or -1 for a random seed")))
            }
            s => s as u64,
        };
        let config = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed,
        };
        config.validate().map_err(|e| CliError::new(e.to_string()))?;
        Ok(config)
    }

    /// Tokens to generate: `None` until end of generation or a full context.
    pub(crate) fn limit(&self, default: usize) -> Result<Option<usize>, CliError> {
        match self.n_predict {
            None => Ok(Some(default)),
            Some(-1 | -2) => Ok(None),
            Some(n) if n < 0 => Err(CliError::new(format!(
                "-n {n}: give a count, -1 (until the end) or -2 (until the context is full)"
            ))),
            Some(n) => Ok(Some(n as usize)),
        }
    }

    /// The positions a context shift keeps (`None`: no context shift), as llama.cpp counts them:
    /// `--keep` prompt tokens (-1: all of them) plus BOS; refused when the context cannot hold
    /// them and room to go on.
    pub(crate) fn shift_keep(
        &self,
        n_prompt: usize,
        bos: bool,
        n_ctx: usize,
    ) -> Result<Option<usize>, CliError> {
        if !self.context_shift || self.no_context_shift {
            return Ok(None);
        }
        let keep = match self.keep {
            -1 => n_prompt,
            k if k < 0 => {
                return Err(CliError::new(format!("--keep {k}: give a count, or -1 (the whole prompt)")))
            }
            k => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let keep = keep.saturating_add(usize::from(bos));
        if keep + 4 > n_ctx {
            return Err(CliError::new(format!(
                "--keep {}: a context shift must keep fewer than {} of the context's {n_ctx} positions; lower --keep or raise -c",
                self.keep,
                n_ctx - 4.min(n_ctx)
            )));
        }
        Ok(Some(keep))
    }

    pub(crate) fn session_options(&self) -> Result<SessionOptions, CliError> {
        let mut opts = SessionOptions { n_ctx: self.ctx, ..Default::default() };
        opts.repack &= !self.no_repack;
        let batch = match (self.batch, self.ubatch) {
            (Some(b), Some(u)) => Some(b.min(u)),
            (b, u) => b.or(u),
        };
        if let Some(b) = batch {
            if b == 0 {
                return Err(CliError::new("-b/-ub: the batch must hold at least one token".into()));
            }
            opts.n_batch = b;
        }
        if !self.image.is_empty() && self.mmproj.is_none() {
            return Err(CliError::new(
                "--image needs the model's vision projector: give it with --mmproj FILE".into(),
            ));
        }
        if let Some(mmproj) = &self.mmproj {
            opts.embeddings_input = true;
            // Counted in the memory plan checked before the model loads.
            opts.projector =
                Some(pinfer::media::projector_memory(mmproj).map_err(|e| CliError::new(e.to_string()))?);
            // (An image attending both ways is one step: Gemma 3's take 256 positions.)
            if batch.is_none() {
                opts.n_batch = opts.n_batch.max(512);
            }
        }
        let guesses = match (self.lookup, &self.model_draft) {
            (Some(n), _) => Some((n, "--lookup")),
            (None, Some(_)) => Some((self.draft_max, "--draft-max")),
            (None, None) => None,
        };
        if let Some((n, flag)) = guesses {
            // (A batch of more guesses would take a prompt's attention kernels and compute other
            // bits than the tokens alone.)
            let most = (opts.n_batch - 1).min(MOST_GUESSES);
            if n == 0 || n > most {
                return Err(CliError::new(format!(
                    "{flag} {n}: give 1 to {most} (fewer guesses than the batch holds, at most {MOST_GUESSES})"
                )));
            }
            // (The guesses' logits are read back.)
            opts.logits_all = true;
        }
        if !(0.0..=1.0).contains(&self.draft_p_min) {
            return Err(CliError::new(format!(
                "--draft-p-min {}: give a probability (0 to 1)",
                self.draft_p_min
            )));
        }
        Ok(opts)
    }

    pub(crate) fn escape(&self) -> bool {
        !self.no_escape
    }

    /// The prompt from -p, -f or stdin, escapes processed; `None` when none was given. A file's
    /// one trailing newline is dropped, as llama-cli does, so `-f` and `-p` with the same text
    /// give the same prompt.
    pub(crate) fn prompt(&self) -> Result<Option<String>, CliError> {
        let text = match (&self.prompt, &self.file) {
            (Some(p), _) if p == "-" => Some(read_stdin()?),
            (Some(p), _) => Some(p.clone()),
            (None, Some(f)) if f.as_os_str() == "-" => Some(read_stdin()?),
            (None, Some(f)) => {
                let mut text = read_text_file(f)?;
                if text.ends_with('\n') {
                    text.pop();
                }
                Some(text)
            }
            (None, None) => None,
        };
        Ok(text.map(|t| if self.escape() { process_escapes(&t) } else { t }))
    }
}

/// A seed from the OS's random source (or the clock where it is missing). 32 bits, as
/// llama.cpp's, so `-s` can give it back.
pub(crate) fn random_seed() -> u64 {
    use std::io::Read;
    let mut bytes = [0u8; 4];
    let seed = match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)) {
        Ok(()) => u32::from_le_bytes(bytes),
        Err(_) => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            now.subsec_nanos() ^ std::process::id().rotate_left(16)
        }
    };
    u64::from(seed)
}

/// `--lookup N` or `-md FILE` for `gen`: refused for a model whose cache cannot go back to any
/// position; the draft model loads with the model's runtime and context and must share its
/// vocabulary.
pub(crate) fn set_speculative(
    args: &GenArgs,
    session: &Session,
    tok: &Tokenizer<'_>,
    gen: &mut Generator<'_>,
) -> Result<(), CliError> {
    let flag = match (&args.lookup, &args.model_draft) {
        (Some(_), _) => "--lookup",
        (None, Some(_)) => "--model-draft",
        (None, None) => return Ok(()),
    };
    if session.engine().has_recurrent_layers() {
        return Err(CliError::new(format!(
            "{flag}: this model has recurrent layers, whose state cannot go back to a guess's position"
        )));
    }
    if let Some(n) = args.lookup {
        gen.set_speculative(Some((Drafter::Lookup, n)));
        return Ok(());
    }
    let Some(path) = &args.model_draft else { return Ok(()) };
    // (Its context is sized as the model's: from -c, or its own maximum up to 4096. Past it, it
    // stops guessing.)
    let opts = SessionOptions { logits_all: false, ..args.session_options()? };
    let draft = Runtime::new(&args.runtime)?.load(path, opts, 0)?;
    let draft_tok = tokenizer(path, draft.gguf())?;
    check_draft(tok, &draft_tok, &draft).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    if args.verbose > 0 {
        errln!("pinfer: draft model {}: {}", path.display(), draft.memory_plan());
    }
    gen.set_speculative(Some((
        Drafter::Model(Box::new(DraftModel::new(draft, args.draft_p_min))),
        args.draft_max,
    )));
    Ok(())
}

/// An encoder gives embeddings, not text: `generate`, `chat` and `serve` refuse it.
pub(crate) fn refuse_encoder(session: &Session, path: &std::path::Path) -> Result<(), CliError> {
    if session.engine().gives_embeddings() {
        return Err(CliError::new(format!(
            "{}: {} is an embedding model (an encoder): it gives vectors, not text; use pinfer embed",
            path.display(),
            session.hparams().arch.name()
        )));
    }
    Ok(())
}

/// Loads the model of `args` with its runtime; reports the kernels and the seed with -v.
pub(crate) fn load(
    args: &GenArgs,
    sampler: &SamplerConfig,
) -> Result<(PathBuf, Session, OwnedTokenizer), CliError> {
    let path = crate::model_path(args.model.clone())?;
    let opts = args.session_options()?;
    let runtime = Runtime::new(&args.runtime)?;
    let session = runtime.load(&path, opts, args.verbose)?;
    refuse_encoder(&session, &path)?;
    if args.verbose > 0 {
        let (n, bytes, secs) = session.repacked();
        let how = if session.from_cache() { "mapped from the repack cache" } else { "repacked" };
        errln!(
            "pinfer: kernels {}, {} threads, {n} weight matrices {how} ({:.1} MiB) in {:.0} ms",
            session.kernels().name(),
            session.threads(),
            bytes as f64 / (1 << 20) as f64,
            secs * 1e3
        );
        let how = if args.seed == -1 { " (random; -s repeats it)" } else { "" };
        errln!("pinfer: seed {}{how}", sampler.seed);
    }
    let tok = tokenizer(&path, session.gguf())?;
    Ok((path, session, tok))
}
