//! Text given to the CLI: read from stdin or a file (UTF-8, refused otherwise), and llama-cli's
//! backslash escapes.

use std::path::Path;

use crate::CliError;

/// All of stdin, as UTF-8 text.
pub fn read_stdin() -> Result<String, CliError> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes).map_err(|e| CliError::new(format!("reading stdin: {e}")))?;
    String::from_utf8(bytes).map_err(|e| CliError::new(format!("stdin: the prompt is not valid UTF-8 ({e})")))
}

/// A text file's contents; refused if it is not a regular file (a FIFO would block) or not UTF-8.
pub fn read_text_file(path: &Path) -> Result<String, CliError> {
    pinfer::output_file::check_input(path)?;
    let bytes = std::fs::read(path).map_err(|e| CliError::new(format!("{}: {e}", path.display())))?;
    String::from_utf8(bytes).map_err(|e| {
        CliError::new(format!(
            "{}: not valid UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// llama-cli's escapes: `\n`, `\r`, `\t`, `\'`, `\"`, `\\` and `\xNN`; any other backslash
/// stays as it is.
pub fn process_escapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('\'') => out.push('\''),
            Some('"') => out.push('"'),
            Some('\\') => out.push('\\'),
            Some('x') => {
                let hex: String = chars.clone().skip(1).take(2).collect();
                match u8::from_str_radix(&hex, 16) {
                    Ok(b) if hex.len() == 2 && b.is_ascii() => {
                        out.push(b as char);
                        chars.next();
                        chars.next();
                    }
                    _ => {
                        out.push('\\');
                        continue;
                    }
                }
            }
            _ => {
                out.push('\\');
                continue;
            }
        }
        chars.next();
    }
    out
}
