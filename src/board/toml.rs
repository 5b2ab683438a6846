//! The TOML subset the board profiles use, parsed without allocating.
//!
//! Accepted: `key = value` lines, `#` comments, blank lines; a value is a basic string without
//! escapes (`"..."` on one line), a non-negative decimal integer, or a one-dimensional array of
//! strings or of integers, which may span lines and end with a trailing comma. Anything else
//! (tables, escapes, floats, booleans, dotted keys, nested arrays) is an error naming the line, so
//! a profile either means what it says or does not load. Strings are slices of the input.

use core::fmt;

/// Why a profile text is not in the accepted subset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TomlError {
    /// 1-based line of the problem.
    pub line: usize,
    /// What is wrong.
    pub problem: &'static str,
}

impl fmt::Display for TomlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.problem)
    }
}

/// One scalar: a string (a slice of the input) or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar<'a> {
    /// A basic string without escapes.
    Str(&'a str),
    /// A non-negative integer.
    Int(u64),
}

/// A value: a scalar or an array of scalars of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// A string or integer.
    Scalar(Scalar<'a>),
    /// An array, validated when parsed; iterate it with [`Array::iter`].
    Array(Array<'a>),
}

/// A validated array: its text between the brackets, re-scanned on iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Array<'a> {
    body: &'a str,
}

impl<'a> Array<'a> {
    /// The items in order.
    pub fn iter(&self) -> impl Iterator<Item = Scalar<'a>> + 'a {
        let mut c = Cursor { text: self.body, pos: 0, line: 0 };
        core::iter::from_fn(move || {
            c.skip_blank(true);
            while c.peek() == Some(b',') {
                c.pos += 1;
                c.skip_blank(true);
            }
            // Validated at parse time: only scalars remain.
            c.scalar().ok().flatten()
        })
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether the array has no items.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}

/// A `key = value` pair and the line it starts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The bare key.
    pub key: &'a str,
    /// The value.
    pub value: Value<'a>,
    /// 1-based line of the key.
    pub line: usize,
}

/// The entries of `text` in order; stops after the first error.
pub fn entries(text: &str) -> impl Iterator<Item = Result<Entry<'_>, TomlError>> + '_ {
    let mut c = Cursor { text, pos: 0, line: 1 };
    let mut failed = false;
    core::iter::from_fn(move || {
        if failed {
            return None;
        }
        let next = c.entry().transpose();
        failed = matches!(next, Some(Err(_)));
        next
    })
}

struct Cursor<'a> {
    text: &'a str,
    pos: usize,
    line: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn error(&self, problem: &'static str) -> TomlError {
        TomlError { line: self.line, problem }
    }

    /// Skips spaces, tabs and comments; also line ends when `newlines`.
    fn skip_blank(&mut self, newlines: bool) {
        while let Some(b) = self.peek() {
            match b {
                b' ' | b'\t' | b'\r' => self.pos += 1,
                b'\n' if newlines => {
                    self.pos += 1;
                    self.line += 1;
                }
                b'#' => {
                    while self.peek().is_some_and(|b| b != b'\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn entry(&mut self) -> Result<Option<Entry<'a>>, TomlError> {
        self.skip_blank(true);
        let Some(first) = self.peek() else { return Ok(None) };
        if first == b'[' {
            return Err(self.error("tables are not supported: profiles are flat `key = value` lines"));
        }
        let line = self.line;
        let start = self.pos;
        while self.peek().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.error("expected a bare key (letters, digits, _ and -)"));
        }
        let key = &self.text[start..self.pos];
        self.skip_blank(false);
        if self.peek() != Some(b'=') {
            return Err(self.error("expected `=` after the key"));
        }
        self.pos += 1;
        self.skip_blank(false);
        let value = if self.peek() == Some(b'[') {
            Value::Array(self.array()?)
        } else {
            Value::Scalar(self.scalar()?.ok_or_else(|| self.error("expected a value"))?)
        };
        self.skip_blank(false);
        match self.peek() {
            None | Some(b'\n') => Ok(Some(Entry { key, value, line })),
            Some(_) => Err(self.error("unexpected text after the value")),
        }
    }

    /// A string or integer at the cursor, `None` if neither starts here.
    fn scalar(&mut self) -> Result<Option<Scalar<'a>>, TomlError> {
        match self.peek() {
            Some(b'"') => {
                self.pos += 1;
                let start = self.pos;
                loop {
                    match self.peek() {
                        Some(b'"') => break,
                        Some(b'\\') => return Err(self.error("escapes are not supported in strings")),
                        Some(b'\n') | None => return Err(self.error("unterminated string")),
                        Some(_) => self.pos += 1,
                    }
                }
                let s = &self.text[start..self.pos];
                self.pos += 1;
                Ok(Some(Scalar::Str(s)))
            }
            Some(b'0'..=b'9') => {
                let mut v: u64 = 0;
                while let Some(d @ b'0'..=b'9') = self.peek() {
                    v = v
                        .checked_mul(10)
                        .and_then(|v| v.checked_add(u64::from(d - b'0')))
                        .ok_or_else(|| self.error("integer too large"))?;
                    self.pos += 1;
                }
                if self.peek().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_') {
                    return Err(self.error("only plain decimal integers are supported"));
                }
                Ok(Some(Scalar::Int(v)))
            }
            _ => Ok(None),
        }
    }

    fn array(&mut self) -> Result<Array<'a>, TomlError> {
        self.pos += 1; // '['
        let start = self.pos;
        let mut kind: Option<bool> = None; // Some(true): strings
        loop {
            self.skip_blank(true);
            if self.peek() == Some(b']') {
                break;
            }
            let item = self.scalar()?.ok_or_else(|| match self.peek() {
                Some(b'[') => self.error("nested arrays are not supported"),
                None => self.error("unterminated array"),
                _ => self.error("array items must be strings or integers"),
            })?;
            let is_str = matches!(item, Scalar::Str(_));
            if kind.is_some_and(|k| k != is_str) {
                return Err(self.error("array mixes strings and integers"));
            }
            kind = Some(is_str);
            self.skip_blank(true);
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => break,
                None => return Err(self.error("unterminated array")),
                Some(_) => return Err(self.error("expected `,` or `]` in the array")),
            }
        }
        let body = &self.text[start..self.pos];
        self.pos += 1; // ']'
        Ok(Array { body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(text: &str) -> Result<heapless::Vec<Entry<'_>, 16>, TomlError> {
        let mut v = heapless::Vec::new();
        for e in entries(text) {
            v.push(e?).unwrap();
        }
        Ok(v)
    }

    #[test]
    fn parses_the_subset() {
        let text =
            "# a board\nname = \"Orange Pi 5\"  # trailing comment\n\nbig = [4, 5,\n  6, 7, # more\n]\n\
                    compat = [\"a,b\", \"c\"]\nempty = []\nn = 3\n";
        let e = all(text).unwrap();
        assert_eq!(e.len(), 5);
        assert_eq!((e[0].key, e[0].value, e[0].line), ("name", Value::Scalar(Scalar::Str("Orange Pi 5")), 2));
        let Value::Array(big) = e[1].value else { panic!() };
        let ints: heapless::Vec<Scalar<'_>, 8> = big.iter().collect();
        assert_eq!(ints, [Scalar::Int(4), Scalar::Int(5), Scalar::Int(6), Scalar::Int(7)]);
        let Value::Array(compat) = e[2].value else { panic!() };
        assert_eq!(compat.iter().collect::<heapless::Vec<_, 4>>(), [Scalar::Str("a,b"), Scalar::Str("c")]);
        assert_eq!(e[2].line, 7);
        let Value::Array(empty) = e[3].value else { panic!() };
        assert!(empty.is_empty() && empty.iter().count() == 0);
        assert_eq!(e[4].value, Value::Scalar(Scalar::Int(3)));
    }

    #[test]
    fn rejects_what_it_does_not_understand_with_the_line() {
        for (text, line, problem) in [
            ("[table]\n", 1, "tables"),
            ("a = \"x\\ty\"\n", 1, "escapes"),
            ("a = \"open\n", 1, "unterminated string"),
            ("\na = 1.5\n", 2, "plain decimal"),
            ("a = true\n", 1, "expected a value"),
            ("a = [1, \"x\"]\n", 1, "mixes"),
            ("a = [[1]]\n", 1, "nested"),
            ("a = [1 2]\n", 1, "expected `,`"),
            ("a = [1,\n2\n", 3, "unterminated array"),
            ("a 1\n", 1, "expected `=`"),
            ("a = 1 b\n", 1, "after the value"),
            ("= 1\n", 1, "bare key"),
            ("a = 99999999999999999999999\n", 1, "too large"),
        ] {
            let err = all(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.problem.contains(problem), "{text:?}: {err}");
        }
    }
}
