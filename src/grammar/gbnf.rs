//! GBNF, llama.cpp's grammar format, read into rules and written in the Lark syntax of the grammar
//! engine (llguidance).
//!
//! The reader follows llama.cpp's parser: rule names of `[a-zA-Z0-9-]`, `::=`, alternatives with
//! `|`, string literals and `[...]` classes with `\x`, `\u`, `\U`, `\t`, `\r`, `\n` and `\\ \" \[
//! \] \-` escapes, `.` for any character, groups, `* + ? {m} {m,} {m,n} {,n}`, `<[id]>` and
//! `<token>` tokens and `!` before one (any other token), `#` comments; a rule ends at a newline
//! unless a group is open or the line ends in `|`. Its limits too: a repetition of more than 2000 is
//! refused (an upper bound above 2000 means unbounded), and so is a grammar whose repetitions would
//! expand past [`MAX_EXPANDED`] symbols. Every error names its line and column.
//!
//! GBNF is a grammar over characters. The Lark written here keeps it so: every literal is split into
//! single-character lexemes and every class is one, so the engine's lexer never has to choose between
//! two multi-character lexemes and the language is exactly the GBNF one.

use std::fmt;
use std::string::{String, ToString};
use std::vec::Vec;
use std::{format, vec};

/// The most symbols a grammar may have once its bounded repetitions are written out.
pub const MAX_EXPANDED: u64 = 200_000;
/// The deepest nesting of groups and repeated repetitions (`((x)*)*`...) a grammar may have: the
/// checks and the translation recurse over it.
pub const MAX_NESTING: usize = 256;
/// llama.cpp's bound on a repetition count.
const MAX_REPETITION: u64 = 2000;

/// A grammar that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GbnfError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// What is wrong there.
    pub message: String,
}

impl fmt::Display for GbnfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "grammar line {}, column {}: {}", self.line, self.column, self.message)
    }
}

impl std::error::Error for GbnfError {}

/// A token named in a grammar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenRef {
    /// `<[123]>`.
    Id(u32),
    /// `<|im_end|>`: the text of one token, resolved against the vocabulary.
    Text(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Atom {
    Literal(Vec<char>),
    Class { negated: bool, ranges: Vec<(char, char)> },
    Any,
    Rule(String, usize),
    Group(Vec<Vec<Item>>),
    Token { not: bool, token: TokenRef, at: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Item {
    atom: Atom,
    min: u64,
    /// `None`: unbounded.
    max: Option<u64>,
}

#[derive(Debug, Clone)]
struct Rule {
    name: String,
    alts: Vec<Vec<Item>>,
}

/// A parsed GBNF grammar: its rules in the order they were defined (a rule defined twice keeps
/// its last definition, as in llama.cpp), `root` among them.
#[derive(Debug, Clone)]
pub struct Gbnf {
    rules: Vec<Rule>,
}

impl Gbnf {
    /// Reads and checks `src`: every referenced rule defined, `root` defined, repetitions in bounds.
    pub fn parse(src: &str) -> Result<Self, GbnfError> {
        let mut p = Parser { src, pos: 0, rules: Vec::new(), depth: 0 };
        p.grammar()?;
        let rules = p.rules;
        for rule in &rules {
            check_refs(src, &rules, &rule.alts)?;
        }
        if !rules.iter().any(|r| r.name == "root") {
            return Err(error_at(src, src.len(), "the grammar has no `root` rule"));
        }
        let mut total = 0u64;
        for rule in &rules {
            total = total.saturating_add(alts_size(&rule.alts));
        }
        if total > MAX_EXPANDED {
            return Err(error_at(
                src,
                0,
                &format!("the grammar expands to {total} symbols once its repetitions are written out (at most {MAX_EXPANDED})"),
            ));
        }
        Ok(Self { rules })
    }

    /// The tokens the grammar names (`<...>`), with their byte offsets, to resolve against a
    /// vocabulary.
    pub fn tokens(&self) -> Vec<(&TokenRef, usize)> {
        fn walk<'a>(alts: &'a [Vec<Item>], out: &mut Vec<(&'a TokenRef, usize)>) {
            for item in alts.iter().flatten() {
                match &item.atom {
                    Atom::Token { token, at, .. } => out.push((token, *at)),
                    Atom::Group(g) => walk(g, out),
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        for r in &self.rules {
            walk(&r.alts, &mut out);
        }
        out
    }

    /// The grammar in llguidance's Lark syntax, `start` deriving `root`; `token_id` gives the id of
    /// a [`TokenRef::Text`] (the caller has resolved every one of [`tokens`](Self::tokens)).
    pub fn to_lark(&self, token_id: &dyn Fn(&TokenRef) -> u32) -> String {
        let mut out = String::from("start: ");
        out.push_str(&rule_name("root"));
        out.push('\n');
        for rule in &self.rules {
            out.push_str(&rule_name(&rule.name));
            out.push_str(": ");
            write_alts(&mut out, &rule.alts, token_id);
            out.push('\n');
        }
        out
    }
}

impl Gbnf {
    /// Whether `text` is a sentence of the grammar: a plain Earley recognizer over characters,
    /// written from the rules alone. It is the reference the engine's constraint is tested
    /// against (slow: for tests and checks, never per token). A grammar naming tokens (`<...>`)
    /// accepts no text where they are required.
    pub fn accepts(&self, text: &str) -> bool {
        let cfg = Cfg::of(self);
        let root = self.rules.iter().position(|r| r.name == "root").expect("parse checked root");
        cfg.recognizes(root, &text.chars().collect::<Vec<_>>())
    }
}

/// A terminal of the flat grammar: one character.
#[derive(Clone, Debug)]
enum Term {
    Char(char),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    /// A token: matches no text.
    Never,
}

impl Term {
    fn matches(&self, c: char) -> bool {
        match self {
            Term::Char(x) => *x == c,
            Term::Class { negated, ranges } => ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated,
            Term::Any => true,
            Term::Never => false,
        }
    }
}

#[derive(Clone, Debug)]
enum Sym {
    T(Term),
    N(usize),
}

/// The rules flattened into productions of terminals and nonterminals (groups, literals and
/// repetitions become helper nonterminals), for [`Gbnf::accepts`].
struct Cfg {
    prods: Vec<(usize, Vec<Sym>)>,
    by_lhs: Vec<Vec<usize>>,
    nullable: Vec<bool>,
}

impl Cfg {
    fn of(g: &Gbnf) -> Self {
        let mut cfg =
            Cfg { prods: Vec::new(), by_lhs: vec![Vec::new(); g.rules.len()], nullable: Vec::new() };
        for (i, rule) in g.rules.iter().enumerate() {
            for seq in &rule.alts {
                let body = cfg.seq(g, seq);
                cfg.add(i, body);
            }
        }
        cfg.nullable = vec![false; cfg.by_lhs.len()];
        loop {
            let mut changed = false;
            for (lhs, body) in &cfg.prods {
                if !cfg.nullable[*lhs] && body.iter().all(|s| matches!(s, Sym::N(n) if cfg.nullable[*n])) {
                    cfg.nullable[*lhs] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        cfg
    }

    fn new_nt(&mut self) -> usize {
        self.by_lhs.push(Vec::new());
        self.by_lhs.len() - 1
    }

    fn add(&mut self, lhs: usize, body: Vec<Sym>) {
        self.by_lhs[lhs].push(self.prods.len());
        self.prods.push((lhs, body));
    }

    fn seq(&mut self, g: &Gbnf, seq: &[Item]) -> Vec<Sym> {
        let mut out = Vec::new();
        for item in seq {
            if item.min == 1 && item.max == Some(1) {
                self.atom_into(g, &item.atom, &mut out);
                continue;
            }
            // The atom as one symbol, repeated: `min` copies, then an unbounded tail or nested
            // optional copies.
            let mut one = Vec::new();
            self.atom_into(g, &item.atom, &mut one);
            let a = if one.len() == 1 {
                one.pop().expect("one symbol")
            } else {
                let n = self.new_nt();
                self.add(n, one);
                Sym::N(n)
            };
            for _ in 0..item.min {
                out.push(a.clone());
            }
            match item.max {
                None => {
                    let r = self.new_nt();
                    self.add(r, Vec::new());
                    self.add(r, vec![a.clone(), Sym::N(r)]);
                    out.push(Sym::N(r));
                }
                Some(max) if max > item.min => {
                    let mut inner: Option<usize> = None;
                    for _ in item.min..max {
                        let o = self.new_nt();
                        self.add(o, Vec::new());
                        let mut body = vec![a.clone()];
                        if let Some(i) = inner {
                            body.push(Sym::N(i));
                        }
                        self.add(o, body);
                        inner = Some(o);
                    }
                    out.push(Sym::N(inner.expect("max > min")));
                }
                Some(_) => {}
            }
        }
        out
    }

    fn atom_into(&mut self, g: &Gbnf, atom: &Atom, out: &mut Vec<Sym>) {
        match atom {
            Atom::Literal(chars) => out.extend(chars.iter().map(|&c| Sym::T(Term::Char(c)))),
            Atom::Class { negated, ranges } => {
                out.push(Sym::T(Term::Class { negated: *negated, ranges: ranges.clone() }))
            }
            Atom::Any => out.push(Sym::T(Term::Any)),
            Atom::Token { .. } => out.push(Sym::T(Term::Never)),
            Atom::Rule(name, _) => {
                let i = g.rules.iter().position(|r| &r.name == name).expect("parse checked the references");
                out.push(Sym::N(i));
            }
            Atom::Group(alts) => {
                let n = self.new_nt();
                for seq in alts {
                    let body = self.seq(g, seq);
                    self.add(n, body);
                }
                out.push(Sym::N(n));
            }
        }
    }

    /// Earley recognition of `text` from `start` (nullable nonterminals are stepped over when
    /// predicted, Aycock and Horspool's fix).
    fn recognizes(&self, start: usize, text: &[char]) -> bool {
        type Item = (usize, usize, usize); // production, dot, origin
        let mut sets: Vec<Vec<Item>> = vec![Vec::new(); text.len() + 1];
        let mut seen: Vec<std::collections::HashSet<Item>> = vec![Default::default(); text.len() + 1];
        for &p in &self.by_lhs[start] {
            if seen[0].insert((p, 0, 0)) {
                sets[0].push((p, 0, 0));
            }
        }
        for k in 0..=text.len() {
            let mut j = 0;
            while j < sets[k].len() {
                let (p, dot, origin) = sets[k][j];
                j += 1;
                let (lhs, body) = &self.prods[p];
                match body.get(dot) {
                    None => {
                        // Complete: advance every item at `origin` waiting for `lhs`.
                        let mut i = 0;
                        while i < sets[origin].len() {
                            let (q, d, o) = sets[origin][i];
                            i += 1;
                            if matches!(self.prods[q].1.get(d), Some(Sym::N(n)) if n == lhs) {
                                let item = (q, d + 1, o);
                                if seen[k].insert(item) {
                                    sets[k].push(item);
                                }
                            }
                        }
                    }
                    Some(Sym::N(n)) => {
                        for &q in &self.by_lhs[*n] {
                            let item = (q, 0, k);
                            if seen[k].insert(item) {
                                sets[k].push(item);
                            }
                        }
                        if self.nullable[*n] {
                            let item = (p, dot + 1, origin);
                            if seen[k].insert(item) {
                                sets[k].push(item);
                            }
                        }
                    }
                    Some(Sym::T(t)) => {
                        if k < text.len() && t.matches(text[k]) {
                            let item = (p, dot + 1, origin);
                            if seen[k + 1].insert(item) {
                                sets[k + 1].push(item);
                            }
                        }
                    }
                }
            }
        }
        sets[text.len()]
            .iter()
            .any(|&(p, dot, origin)| origin == 0 && self.prods[p].0 == start && dot == self.prods[p].1.len())
    }
}

/// A GBNF rule name as a Lark rule name: lower case (upper case would make it a terminal), so
/// `A` becomes `_a` (GBNF names have no `_`: the mapping is one to one), after a prefix that keeps
/// it clear of `start` and of Lark's keywords.
fn rule_name(name: &str) -> String {
    let mut s = String::from("g_");
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

fn write_alts(out: &mut String, alts: &[Vec<Item>], token_id: &dyn Fn(&TokenRef) -> u32) {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (j, item) in seq.iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            write_item(out, item, token_id);
        }
    }
}

fn write_item(out: &mut String, item: &Item, token_id: &dyn Fn(&TokenRef) -> u32) {
    if item.max == Some(0) {
        // `x{0}`: the empty string (the engine refuses a repetition of at most 0).
        out.push_str("\"\"");
        return;
    }
    let repeated = !(item.min == 1 && item.max == Some(1));
    let needs_group = repeated && matches!(&item.atom, Atom::Literal(c) if c.len() != 1);
    if needs_group || matches!(item.atom, Atom::Group(_)) {
        out.push('(');
    }
    match &item.atom {
        Atom::Literal(chars) if chars.is_empty() => out.push_str("\"\""),
        Atom::Literal(chars) => {
            for (k, &c) in chars.iter().enumerate() {
                if k > 0 {
                    out.push(' ');
                }
                write_char_literal(out, c);
            }
        }
        // `[^]`: any character (an empty negated class is no regex).
        Atom::Class { negated: true, ranges } if ranges.is_empty() => out.push_str("/(?s:.)/"),
        Atom::Class { negated, ranges } => {
            out.push_str("/[");
            if *negated {
                out.push('^');
            }
            for &(lo, hi) in ranges {
                write_regex_char(out, lo);
                if hi != lo {
                    out.push('-');
                    write_regex_char(out, hi);
                }
            }
            out.push_str("]/");
        }
        Atom::Any => out.push_str("/(?s:.)/"),
        Atom::Rule(name, _) => out.push_str(&rule_name(name)),
        Atom::Group(alts) => write_alts(out, alts, token_id),
        Atom::Token { not, token, .. } => {
            out.push_str(if *not { "<[^" } else { "<[" });
            out.push_str(&token_id(token).to_string());
            out.push_str("]>");
        }
    }
    if needs_group || matches!(item.atom, Atom::Group(_)) {
        out.push(')');
    }
    if repeated {
        match (item.min, item.max) {
            (0, None) => out.push('*'),
            (1, None) => out.push('+'),
            (0, Some(1)) => out.push('?'),
            (m, None) => out.push_str(&format!("{{{m},}}")),
            (m, Some(n)) if m == n => out.push_str(&format!("{{{m}}}")),
            (m, Some(n)) => out.push_str(&format!("{{{m},{n}}}")),
        }
    }
}

/// One character as a Lark string (JSON escapes for what must be escaped, the character itself
/// otherwise).
fn write_char_literal(out: &mut String, c: char) {
    out.push('"');
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\u{:04x}", c as u32)),
        c => out.push(c),
    }
    out.push('"');
}

/// One character inside a regex class of `/[...]/`: escaped by code point unless it is a plain
/// letter or digit (no class metacharacter, no `/` that would end the regex).
fn write_regex_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        out.push_str(&format!("\\x{{{:x}}}", c as u32));
    }
}

/// Symbols of `alts` once bounded repetitions are written out (saturating).
fn alts_size(alts: &[Vec<Item>]) -> u64 {
    let mut total = 0u64;
    for item in alts.iter().flatten() {
        let one = match &item.atom {
            Atom::Literal(c) => c.len().max(1) as u64,
            Atom::Group(g) => alts_size(g),
            _ => 1,
        };
        let times = item.max.unwrap_or(item.min).max(item.min).max(1);
        total = total.saturating_add(one.saturating_mul(times));
    }
    total
}

fn check_refs(src: &str, rules: &[Rule], alts: &[Vec<Item>]) -> Result<(), GbnfError> {
    for item in alts.iter().flatten() {
        match &item.atom {
            Atom::Rule(name, at) if !rules.iter().any(|r| &r.name == name) => {
                return Err(error_at(src, *at, &format!("rule `{name}` is used but never defined")));
            }
            Atom::Group(g) => check_refs(src, rules, g)?,
            _ => {}
        }
    }
    Ok(())
}

/// The error `message` at byte `pos` of `src`.
fn error_at(src: &str, pos: usize, message: &str) -> GbnfError {
    let (line, column) = line_column(src, pos);
    GbnfError { line, column, message: message.to_string() }
}

/// The 1-based line and column (in characters) of byte `pos` of `src`.
pub(crate) fn line_column(src: &str, pos: usize) -> (usize, usize) {
    let before = &src[..pos.min(src.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// How many groups `item` sits in, counting down its first alternative's first item (what
/// repeated repetitions build).
fn nesting_of(item: &Item) -> usize {
    let mut depth = 0;
    let mut at = item;
    while let Atom::Group(alts) = &at.atom {
        depth += 1;
        match alts.first().and_then(|seq| seq.first()) {
            Some(inner) => at = inner,
            None => break,
        }
    }
    depth
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

struct Parser<'s> {
    src: &'s str,
    pos: usize,
    rules: Vec<Rule>,
    /// Groups open here, and repetitions wrapped around repetitions in the current sequence.
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.src[self.pos..].chars().nth(n)
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn err(&self, message: &str) -> GbnfError {
        error_at(self.src, self.pos, message)
    }

    fn what_is_here(&self) -> String {
        match self.peek() {
            None => "the end of the grammar".to_string(),
            Some('\n') | Some('\r') => "the end of the line".to_string(),
            Some(c) => format!("`{c}`"),
        }
    }

    /// Skips blanks and comments, and line ends too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => {
                    self.pos += 1;
                }
                '\r' | '\n' if newlines => {
                    self.pos += 1;
                }
                '#' => {
                    while let Some(c) = self.peek() {
                        if c == '\r' || c == '\n' {
                            break;
                        }
                        self.bump();
                    }
                }
                _ => break,
            }
        }
    }

    fn grammar(&mut self) -> Result<(), GbnfError> {
        self.space(true);
        while self.peek().is_some() {
            self.rule()?;
        }
        Ok(())
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word_char) {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err(&format!("expected a rule name, found {}", self.what_is_here())));
        }
        Ok(self.src[start..self.pos].to_string())
    }

    fn rule(&mut self) -> Result<(), GbnfError> {
        let name = self.name()?;
        self.space(false);
        if !self.src[self.pos..].starts_with("::=") {
            return Err(
                self.err(&format!("expected `::=` after rule name `{name}`, found {}", self.what_is_here()))
            );
        }
        self.pos += 3;
        self.space(true);
        let alts = self.alternates(false)?;
        match self.peek() {
            None => {}
            Some('\r') => {
                self.pos += 1;
                if self.peek() == Some('\n') {
                    self.pos += 1;
                }
            }
            Some('\n') => self.pos += 1,
            Some(_) => {
                return Err(self.err(&format!("expected the end of the line, found {}", self.what_is_here())));
            }
        }
        self.space(true);
        match self.rules.iter_mut().find(|r| r.name == name) {
            Some(r) => r.alts = alts,
            None => self.rules.push(Rule { name, alts }),
        }
        Ok(())
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Item>>, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>, GbnfError> {
        let mut seq: Vec<Item> = Vec::new();
        // Each repetition multiplies the rules it writes out (llama.cpp's MAX_REPETITION_THRESHOLD).
        while let Some(c) = self.peek() {
            let atom = match c {
                '"' => {
                    self.pos += 1;
                    let mut chars = Vec::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("a string literal is not closed")),
                            Some('"') => break,
                            Some(_) => chars.push(self.char()?),
                        }
                    }
                    self.pos += 1;
                    Atom::Literal(chars)
                }
                '[' => {
                    self.pos += 1;
                    let negated = self.peek() == Some('^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("a character class is not closed")),
                            Some(']') => break,
                            Some(_) => {}
                        }
                        let at = self.pos;
                        let lo = self.char()?;
                        let mut hi = lo;
                        if self.peek() == Some('-') && self.peek_at(1).is_some_and(|c| c != ']') {
                            self.pos += 1;
                            hi = self.char()?;
                            if hi < lo {
                                return Err(error_at(
                                    self.src,
                                    at,
                                    &format!("range `{lo}-{hi}` is backwards"),
                                ));
                            }
                        }
                        ranges.push((lo, hi));
                    }
                    self.pos += 1;
                    if ranges.is_empty() && !negated {
                        return Err(self.err("an empty character class `[]` matches nothing"));
                    }
                    Atom::Class { negated, ranges }
                }
                '<' | '!' => {
                    let at = self.pos;
                    let not = c == '!';
                    if not {
                        self.pos += 1;
                    }
                    Atom::Token { not, token: self.token()?, at }
                }
                c if is_word_char(c) => {
                    let at = self.pos;
                    Atom::Rule(self.name()?, at)
                }
                '(' => {
                    if self.depth >= MAX_NESTING {
                        return Err(self.err(&format!("groups nested deeper than {MAX_NESTING}")));
                    }
                    self.pos += 1;
                    self.space(true);
                    self.depth += 1;
                    let alts = self.alternates(true);
                    self.depth -= 1;
                    let alts = alts?;
                    if self.peek() != Some(')') {
                        return Err(self.err(&format!("expected `)`, found {}", self.what_is_here())));
                    }
                    self.pos += 1;
                    Atom::Group(alts)
                }
                '.' => {
                    self.pos += 1;
                    Atom::Any
                }
                '*' | '+' | '?' | '{' => {
                    let at = self.pos;
                    let (min, max) = self.repetition()?;
                    let Some(last) = seq.last_mut() else {
                        return Err(error_at(self.src, at, &format!("`{c}` follows nothing to repeat")));
                    };
                    if !(last.min == 1 && last.max == Some(1)) {
                        // `x**`, `x?{2}`: repeat the repetition (each one a level of nesting).
                        if nesting_of(last) >= MAX_NESTING {
                            return Err(error_at(
                                self.src,
                                at,
                                &format!("repetitions nested deeper than {MAX_NESTING}"),
                            ));
                        }
                        let inner = seq.pop().expect("checked above");
                        seq.push(Item { atom: Atom::Group(vec![vec![inner]]), min, max });
                    } else {
                        last.min = min;
                        last.max = max;
                    }
                    self.space(nested);
                    continue;
                }
                _ => break,
            };
            seq.push(Item { atom, min: 1, max: Some(1) });
            self.space(nested);
        }
        Ok(seq)
    }

    /// `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`, `{,n}` (llama.cpp's bounds).
    fn repetition(&mut self) -> Result<(u64, Option<u64>), GbnfError> {
        let c = self.bump().expect("the caller saw it");
        let (min, max) = match c {
            '*' => (0, None),
            '+' => (1, None),
            '?' => (0, Some(1)),
            _ => {
                self.space(true);
                let min = if self.peek() == Some(',') { 0 } else { self.int()? };
                self.space(true);
                let max = match self.peek() {
                    Some('}') => Some(min),
                    Some(',') => {
                        self.pos += 1;
                        self.space(true);
                        if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                            let at = self.pos;
                            let n = self.int()?;
                            self.space(true);
                            if n < min {
                                return Err(error_at(
                                    self.src,
                                    at,
                                    &format!("repetition `{{{min},{n}}}` has its maximum below its minimum"),
                                ));
                            }
                            // (llama.cpp: a maximum above its threshold means no maximum.)
                            (n <= MAX_REPETITION).then_some(n)
                        } else {
                            None
                        }
                    }
                    _ => {
                        return Err(self.err(&format!(
                            "expected `,` or `}}` in a repetition, found {}",
                            self.what_is_here()
                        )))
                    }
                };
                if self.peek() != Some('}') {
                    return Err(self.err(&format!("expected `}}`, found {}", self.what_is_here())));
                }
                self.pos += 1;
                if min > MAX_REPETITION {
                    return Err(
                        self.err(&format!("a repetition of at least {min} is more than {MAX_REPETITION}"))
                    );
                }
                (min, max)
            }
        };
        Ok((min, max))
    }

    fn int(&mut self) -> Result<u64, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.err(&format!("expected a number, found {}", self.what_is_here())));
        }
        self.src[start..self.pos].parse().map_err(|_| error_at(self.src, start, "this number is too large"))
    }

    /// `<[id]>` or `<text>`.
    fn token(&mut self) -> Result<TokenRef, GbnfError> {
        if self.peek() != Some('<') {
            return Err(self.err(&format!("expected `<` of a token, found {}", self.what_is_here())));
        }
        let start = self.pos;
        self.pos += 1;
        if self.peek() == Some('[') {
            self.pos += 1;
            let at = self.pos;
            let id = self.int()?;
            let id = u32::try_from(id).map_err(|_| error_at(self.src, at, "this token id is too large"))?;
            if self.peek() != Some(']') || self.peek_at(1) != Some('>') {
                return Err(self.err(&format!("expected `]>`, found {}", self.what_is_here())));
            }
            self.pos += 2;
            return Ok(TokenRef::Id(id));
        }
        while let Some(c) = self.peek() {
            if c == '>' {
                self.pos += 1;
                return Ok(TokenRef::Text(self.src[start..self.pos].to_string()));
            }
            if c == '\n' {
                break;
            }
            self.bump();
        }
        Err(error_at(self.src, start, "a token `<...>` is not closed"))
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char, GbnfError> {
        let at = self.pos;
        let c = self.bump().ok_or_else(|| self.err("unexpected end of the grammar"))?;
        if c != '\\' {
            return Ok(c);
        }
        let e = self.bump().ok_or_else(|| self.err("unexpected end of the grammar after `\\`"))?;
        let digits = match e {
            'x' => 2,
            'u' => 4,
            'U' => 8,
            't' => return Ok('\t'),
            'r' => return Ok('\r'),
            'n' => return Ok('\n'),
            '\\' | '"' | '[' | ']' | '-' => return Ok(e),
            _ => return Err(error_at(self.src, at, &format!("unknown escape `\\{e}`"))),
        };
        let mut v = 0u32;
        for _ in 0..digits {
            let d = self
                .peek()
                .and_then(|c| c.to_digit(16))
                .ok_or_else(|| error_at(self.src, at, &format!("`\\{e}` needs {digits} hex digits")))?;
            v = (v << 4) | d;
            self.pos += 1;
        }
        char::from_u32(v).ok_or_else(|| error_at(self.src, at, &format!("U+{v:X} is not a character")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lark(src: &str) -> String {
        Gbnf::parse(src).unwrap().to_lark(&|_| 7)
    }

    #[test]
    fn writes_rules_as_single_character_lexemes() {
        let l = lark("root ::= \"ab\" [a-z0-9_]* Item?\nItem ::= (\"x\" | \"\\n\")+ .\n");
        assert_eq!(
            l,
            "start: g_root\ng_root: \"a\" \"b\" /[a-z0-9\\x{5f}]/* g__item?\ng__item: (\"x\" | \"\\u000a\")+ /(?s:.)/\n"
        );
    }

    #[test]
    fn repetitions_and_tokens() {
        let l = lark("root ::= \"ab\"{2,5} [^\"]{3} x{2,} <[12]> !<|end|>\nx ::= \"\"\n");
        assert!(l.contains("(\"a\" \"b\"){2,5} /[^\\x{22}]/{3} g_x{2,} <[7]> <[^7]>"), "{l}");
    }

    #[test]
    fn multi_line_rules_follow_llama_cpp() {
        // A group spans lines; a trailing `|` continues the rule; a newline ends it.
        let g = Gbnf::parse("root ::= (\n  \"a\"\n  | \"b\" ) c |\n  c\nc ::= \"c\" # comment\n").unwrap();
        assert_eq!(g.rules.len(), 2);
        assert_eq!(g.rules[0].alts.len(), 2);
    }

    #[test]
    fn errors_name_line_and_column() {
        let e = Gbnf::parse("root ::= \"a\" b\n").unwrap_err();
        assert_eq!((e.line, e.column), (1, 14), "{e}");
        assert!(e.message.contains("`b`"), "{e}");
        let e = Gbnf::parse("root ::= \"a\"\nx ::= [b-a]\n").unwrap_err();
        assert_eq!((e.line, e.column), (2, 8), "{e}");
        let e = Gbnf::parse("x ::= \"a\"\n").unwrap_err();
        assert!(e.message.contains("root"), "{e}");
        let e = Gbnf::parse("root ::= \"a\n").unwrap_err();
        assert!(e.message.contains("not closed"), "{e}");
        let e = Gbnf::parse("root ::= * \"a\"\n").unwrap_err();
        assert_eq!((e.line, e.column), (1, 10), "{e}");
        let e = Gbnf::parse("root ::= \"a\"{2001}\n").unwrap_err();
        assert!(e.message.contains("2000"), "{e}");
        let e = Gbnf::parse("root ::= \"\\q\"\n").unwrap_err();
        assert!(e.message.contains("escape"), "{e}");
        let e = Gbnf::parse("root ::= x\nx ::= \"a\" \"b\" ]\n").unwrap_err();
        assert_eq!(e.line, 2, "{e}");
    }

    #[test]
    fn nested_repetitions_are_bounded() {
        // 2000^3 symbols written out: refused before the engine sees it.
        let e = Gbnf::parse("root ::= ((\"a\"{2000}){2000}){2000}\n").unwrap_err();
        assert!(e.message.contains("expands"), "{e}");
        // A large but reasonable one is fine.
        Gbnf::parse("root ::= [0-9]{1,2000}\n").unwrap();
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let stars = format!("root ::= \"a\"{}\n", "*".repeat(100_000));
        let e = Gbnf::parse(&stars).unwrap_err();
        assert!(e.message.contains("nested"), "{e}");
        let parens = format!("root ::= {}\"a\"{}\n", "(".repeat(100_000), ")".repeat(100_000));
        let e = Gbnf::parse(&parens).unwrap_err();
        assert!(e.message.contains("nested"), "{e}");
        Gbnf::parse(&format!("root ::= {}\"a\"{}\n", "(".repeat(200), ")".repeat(200))).unwrap();
    }

    #[test]
    fn zero_repetitions_and_any_class_translate() {
        assert!(lark("root ::= \"a\"{0} \"b\"\n").ends_with("g_root: \"\" \"b\"\n"));
        assert!(lark("root ::= [^]\n").ends_with("g_root: /(?s:.)/\n"));
        let g = Gbnf::parse("root ::= \"a\"{0,0} [^]\n").unwrap();
        assert!(g.accepts("z") && !g.accepts("az"));
    }

    #[test]
    fn an_upper_bound_over_the_limit_means_unbounded() {
        assert!(lark("root ::= \"a\"{1,5000}\n").ends_with("g_root: \"a\"+\n"));
    }

    #[test]
    fn the_reference_recognizer_follows_the_rules() {
        let g = Gbnf::parse("root ::= [a-z]* \"ing\" (\",\" root)?\n").unwrap();
        assert!(g.accepts("running"));
        assert!(g.accepts("ing,singing"));
        assert!(!g.accepts("runnin"));
        assert!(!g.accepts("running,"));
        let g = Gbnf::parse("root ::= \"a\"{2,3} [^b]? x\nx ::= | \"b\" x\n").unwrap();
        for (t, ok) in [
            ("aa", true),
            ("aaa", true),
            ("a", false),
            ("aaaa", true),
            ("aaaaa", false),
            ("aacbbb", true),
            ("aab", true),
        ] {
            assert_eq!(g.accepts(t), ok, "{t}");
        }
        let g = Gbnf::parse("root ::= <[5]> | \"t\"\n").unwrap();
        assert!(g.accepts("t") && !g.accepts(""));
    }

    #[test]
    fn rule_names_map_one_to_one() {
        assert_eq!(rule_name("Foo-1"), "g__foo-1");
        assert_ne!(rule_name("foo"), rule_name("Foo"));
    }
}
