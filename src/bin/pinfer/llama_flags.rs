//! llama.cpp's spellings: its multi-letter single-dash flags (`-cnv`, `-ngl`, `-ub`, ...) become
//! the long flags clap knows, before clap reads them, so they are never misread as clusters of
//! short flags (`-cnv` as `-c nv`). Values are never rewritten: the token after a flag that takes
//! a value is skipped (`-p -cnv` keeps its prompt). And `pinfer -m M -p P` (no subcommand, as
//! llama-cli is typed) runs `generate`.

use std::ffi::OsString;

use clap::CommandFactory;

use crate::{Cli, CliError};

/// llama.cpp's single-dash spellings pinfer takes, and the long flag each means.
const SPELLINGS: [(&str, &str); 11] = [
    ("-np", "--parallel"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-cnv", "--conversation"),
    ("-no-cnv", "--no-conversation"),
    ("-ngl", "--n-gpu-layers"),
    ("-fa", "--flash-attn"),
    ("-ub", "--ubatch-size"),
    ("-sys", "--system"),
    ("-co", "--color"),
    ("-md", "--model-draft"),
];

/// llama.cpp's spellings of a Hugging Face repository as the model (`-hf USER/REPO[:QUANT]`).
const HF_REPO: [&str; 3] = ["-hf", "-hfr", "--hf-repo"];

/// llama.cpp flags pinfer does not have yet: refused by name instead of being misread.
const NOT_YET: [(&str, &str); 6] = [
    ("-nkvo", "--no-kv-offload"),
    ("-dkvc", "--dump-kv-cache"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-ot", "--override-tensor"),
    ("-cmoe", "--cpu-moe"),
];

/// Whether the flag token `tok` of `sub` takes a value from the next token.
fn takes_next(sub: &clap::Command, tok: &str) -> bool {
    if tok.contains('=') {
        return false;
    }
    let takes =
        |a: &clap::Arg| a.get_action().takes_values() && a.get_num_args().is_some_and(|n| n.min_values() > 0);
    if let Some(long) = tok.strip_prefix("--") {
        return sub
            .get_arguments()
            .find(|a| a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|al| al.contains(&long)))
            .is_some_and(takes);
    }
    // A cluster of short flags ("-vp"): the first that takes a value takes the rest of the
    // cluster, or the next token when it is the cluster's last letter ("-t2" holds its value).
    let letters: Vec<char> = tok.chars().skip(1).collect();
    for (i, c) in letters.iter().enumerate() {
        match sub.get_arguments().find(|a| a.get_short() == Some(*c)) {
            Some(a) if takes(a) => return i + 1 == letters.len(),
            Some(_) => continue,
            None => return false,
        }
    }
    false
}

/// The arguments with llama.cpp's spellings made clap's, and `generate` inserted when no
/// subcommand is named.
pub fn rewrite(mut args: Vec<OsString>) -> Result<Vec<OsString>, CliError> {
    let mut cli = Cli::command();
    cli.build(); // fills in each argument's number of values
    let first = args.get(1).and_then(|a| a.to_str()).unwrap_or("");
    let asks_top_level = matches!(first, "-h" | "--help" | "-V" | "--version");
    if first.starts_with('-') && !asks_top_level {
        args.insert(1, "generate".into());
    }
    let Some(sub) = args.get(1).and_then(|a| a.to_str()).and_then(|name| cli.find_subcommand(name)) else {
        return Ok(args);
    };
    let mut i = 2;
    while i < args.len() {
        let Some(tok) = args[i].to_str() else {
            i += 1;
            continue;
        };
        if tok == "--" {
            break;
        }
        let (flag, value) = match tok.split_once('=') {
            Some((f, v)) if !f.starts_with("--") => (f, Some(v)),
            _ => (tok, None),
        };
        let hf = match tok.split_once('=') {
            Some((f, v)) if HF_REPO.contains(&f) => Some((f.to_string(), Some(v.to_string()))),
            _ if HF_REPO.contains(&tok) => Some((tok.to_string(), None)),
            _ => None,
        };
        if let Some((flag, value)) = hf {
            // `-hf USER/REPO[:QUANT]`: the store's model (`-m hf:USER/REPO[:QUANT]`).
            let repo = match value {
                Some(v) => v,
                None if i + 1 < args.len() => args.remove(i + 1).to_string_lossy().into_owned(),
                None => return Err(CliError::new(format!("{flag} wants USER/REPO or USER/REPO:QUANT"))),
            };
            if !sub.get_arguments().any(|a| a.get_long() == Some("model")) {
                return Err(CliError::new(format!("{flag}: `{}` takes no model", sub.get_name())));
            }
            args[i] = format!("--model=hf:{repo}").into();
            i += 1;
            continue;
        }
        if let Some((_, long)) = SPELLINGS.iter().find(|(short, _)| *short == flag) {
            let new = match value {
                Some(v) => format!("{long}={v}"),
                None => long.to_string(),
            };
            args[i] = new.into();
        } else if let Some((short, long)) = NOT_YET.iter().find(|(short, _)| *short == flag) {
            return Err(CliError::new(format!(
                "{short} ({long}) is a llama.cpp option pinfer does not have yet"
            )));
        }
        let tok = args[i].to_str().unwrap_or("").to_string();
        i += if tok.starts_with('-') && takes_next(sub, &tok) { 2 } else { 1 };
    }
    Ok(args)
}
