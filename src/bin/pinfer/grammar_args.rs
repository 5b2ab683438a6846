//! `--grammar`, `--grammar-file`, `-j/--json-schema`, `--json-schema-file`, `--regex`: the output's
//! grammar on the command line, as llama-cli takes it. The text is read and a GBNF grammar or a
//! schema's JSON checked before the model loads; it is compiled against the vocabulary after.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use pinfer::grammar::{Constraint, Gbnf, GrammarSpec, Vocab};
use pinfer::tokenizer::Tokenizer;

use crate::CliError;

/// The grammar options of `generate` and `chat`.
#[derive(Args, Debug, Clone, Default)]
pub struct GrammarArgs {
    /// Constrain the output to a GBNF grammar (llama.cpp's format, starting at `root`).
    #[arg(long = "grammar", value_name = "GBNF", group = "constraint", allow_hyphen_values = true)]
    pub grammar: Option<String>,
    /// Constrain the output to the GBNF grammar in FILE.
    #[arg(long = "grammar-file", value_name = "FILE", group = "constraint")]
    pub grammar_file: Option<PathBuf>,
    /// Constrain the output to JSON matching this JSON Schema (`{}`: any JSON value).
    #[arg(
        short = 'j',
        long = "json-schema",
        value_name = "SCHEMA",
        group = "constraint",
        allow_hyphen_values = true
    )]
    pub json_schema: Option<String>,
    /// Constrain the output to JSON matching the JSON Schema in FILE.
    #[arg(long = "json-schema-file", value_name = "FILE", group = "constraint")]
    pub json_schema_file: Option<PathBuf>,
    /// Constrain the output to text matching a regular expression (the whole output).
    #[arg(long = "regex", value_name = "REGEX", group = "constraint", allow_hyphen_values = true)]
    pub regex: Option<String>,
}

fn read(path: &Path, what: &str) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|e| CliError::new(format!("{what} {}: {e}", path.display())))
}

impl GrammarArgs {
    /// The grammar asked for, read and checked as far as it can be without the model: GBNF syntax,
    /// the schema's JSON. Errors name the line and column.
    pub(crate) fn spec(&self) -> Result<Option<GrammarSpec>, CliError> {
        let (spec, origin) = if let Some(g) = &self.grammar {
            (GrammarSpec::Gbnf(g.clone()), "--grammar".to_string())
        } else if let Some(f) = &self.grammar_file {
            (GrammarSpec::Gbnf(read(f, "--grammar-file")?), f.display().to_string())
        } else if let Some(s) = &self.json_schema {
            (GrammarSpec::JsonSchema(s.clone()), "--json-schema".to_string())
        } else if let Some(f) = &self.json_schema_file {
            (GrammarSpec::JsonSchema(read(f, "--json-schema-file")?), f.display().to_string())
        } else if let Some(r) = &self.regex {
            (GrammarSpec::Regex(r.clone()), "--regex".to_string())
        } else {
            return Ok(None);
        };
        let checked = match &spec {
            GrammarSpec::Gbnf(src) => Gbnf::parse(src).map(|_| ()).map_err(|e| e.to_string()),
            GrammarSpec::JsonSchema(src) => serde_json::from_str::<serde_json::Value>(src)
                .map(|_| ())
                .map_err(|e| format!("not valid JSON (line {}, column {}): {e}", e.line(), e.column())),
            _ => Ok(()),
        };
        checked.map_err(|e| CliError::new(format!("{origin}: {e}")))?;
        Ok(Some(spec))
    }
}

/// `spec` compiled against the vocabulary of `tok` (`vocab` caches that vocabulary for later
/// turns).
pub(crate) fn compile(
    spec: &GrammarSpec,
    tok: &Tokenizer<'_>,
    vocab: &mut Option<Arc<Vocab>>,
) -> Result<Constraint, CliError> {
    let v = match vocab {
        Some(v) => v,
        None => vocab.insert(Vocab::new(tok).map_err(|e| CliError::new(e.to_string()))?),
    };
    v.compile(spec).map_err(|e| CliError::new(e.to_string()))
}
