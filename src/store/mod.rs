//! The model store: the places users already keep GGUF models, read in place.
//!
//! - Hugging Face's hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//!   `~/.cache/huggingface/hub`), the layout huggingface_hub and llama.cpp's `-hf` write:
//!   `models--USER--REPO/refs/main` names a commit, `snapshots/COMMIT/PATH` links to
//!   `blobs/SHA256`. A model is `USER/REPO:QUANT` (the quant tag of its file name).
//! - Ollama's store (`$OLLAMA_MODELS`, else `~/.ollama/models`, and the Linux service's
//!   `/usr/share/ollama/.ollama/models`): `manifests/HOST/NAMESPACE/NAME/TAG` lists layers whose
//!   `blobs/sha256-HEX` are the GGUF (`application/vnd.ollama.image.model`) and the projector.
//!   A model is `NAME:TAG` (`HOST/NAMESPACE/NAME:TAG` off Ollama's own registry and namespace).
//!   Ollama's files are never changed: pinfer runs them where they are.
//!
//! Every name and path read from the store is checked before it is joined to a directory: a
//! name component is ASCII letters, digits, `.`, `_` and `-`, not starting with `.`; an Ollama
//! digest is `sha256:` and 64 hex digits; a snapshot's file must resolve inside its repository.

use std::fs;
use std::path::{Path, PathBuf};
use std::string::{String, ToString};
use std::vec::Vec;
use std::{format, vec};

/// The quant tags a file name may carry, longest first where one contains another
/// (`Q4_K_M` before `Q4_K`), matched case-insensitively between `-`, `.` or `_` separators.
const QUANT_TAGS: [&str; 36] = [
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL",
    "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "Q2_K_S", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1",
    "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "BF16", "F16", "F32", "Q4_K",
    "Q5_K", "Q3_K",
];
/// The quant `-hf REPO` picks when none is named (llama.cpp's default).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// Where a stored model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Hugging Face's hub cache.
    HuggingFace,
    /// Ollama's store (read only).
    Ollama,
}

/// A model in the store: the GGUF file (the first part of a split one), its other parts, and
/// the vision projector stored with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredModel {
    /// `USER/REPO:QUANT` or Ollama's `NAME:TAG`.
    pub name: String,
    /// Which store holds it.
    pub source: Source,
    /// The model's GGUF files in order (one, or the parts `-00001-of-0000N` of a split file).
    pub files: Vec<PathBuf>,
    /// An mmproj GGUF stored with it.
    pub mmproj: Option<PathBuf>,
    /// Bytes of `files` (the projector not counted).
    pub bytes: u64,
}

/// A model name as a user writes it: `hf:USER/REPO[:QUANT]` (or `USER/REPO[:QUANT]` after
/// `-hf`), `ollama:NAME[:TAG]` (tag `latest` when none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelRef {
    /// A repository of Hugging Face's hub.
    HuggingFace {
        /// `USER/REPO`.
        repo: String,
        /// The quant tag (the file's), [`DEFAULT_QUANT`] when `None`.
        quant: Option<String>,
    },
    /// A model of Ollama's registry.
    Ollama {
        /// `NAME`, `NAMESPACE/NAME` or `HOST/NAMESPACE/NAME`.
        name: String,
        /// `latest` when the name has none.
        tag: String,
    },
}

/// Why a name or the store could not give a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The name is not a model name (path characters, empty parts, too long).
    BadName(String),
    /// Nothing in the store answers the name; `known` lists what the repository does hold.
    NotFound {
        /// The name asked for.
        name: String,
        /// The repository's models.
        known: Vec<String>,
    },
    /// A file of the store is unreadable or malformed.
    Corrupt(String),
    /// The model is Ollama's: pinfer does not change Ollama's files.
    ReadOnly(String),
    /// A store directory another user can change (see `check_dir`).
    Unsafe(String),
    /// A filesystem operation failed.
    Io(String),
}

impl core::fmt::Display for StoreError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::BadName(s) => write!(f, "not a model name: {s}"),
            Self::NotFound { name, known } if known.is_empty() => write!(f, "{name}: not in the model store"),
            Self::NotFound { name, known } => {
                write!(f, "{name}: not in the model store (the repository holds {})", known.join(", "))
            }
            Self::Corrupt(s) => write!(f, "model store: {s}"),
            Self::ReadOnly(s) => {
                write!(f, "{s} is Ollama's: remove it with `ollama rm` (pinfer never changes Ollama's files)")
            }
            Self::Io(s) => write!(f, "model store: {s}"),
            Self::Unsafe(s) => write!(f, "model store refused: {s}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// Longest name component and whole name the store accepts.
const MAX_COMPONENT: usize = 96;
const MAX_NAME: usize = 256;

/// Whether `s` is one safe name component (see the module's header).
fn component_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_COMPONENT
        && !s.starts_with('.')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Refuses a store directory another user could change under pinfer: one anybody may write
/// (without the sticky bit), or for a store pinfer writes (`ours`), one owned by another user than
/// this process's or root. A missing directory is no store, and fine.
fn check_dir(dir: &Path, ours: bool) -> Result<(), StoreError> {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = fs::metadata(dir) else { return Ok(()) };
    if m.mode() & 0o002 != 0 && m.mode() & 0o1000 == 0 {
        return Err(StoreError::Unsafe(format!(
            "{} is writable by every user (mode {:o}): another user could replace its models; `chmod o-w` it",
            dir.display(),
            m.mode() & 0o7777
        )));
    }
    let me = nix::unistd::geteuid().as_raw();
    if ours && m.uid() != me && m.uid() != 0 {
        return Err(StoreError::Unsafe(format!(
            "{} belongs to user {} (pinfer runs as {me}): another user's store is not pinfer's to use",
            dir.display(),
            m.uid()
        )));
    }
    Ok(())
}

impl ModelRef {
    /// `hf:...` or `ollama:...`; `None` for anything else (a path).
    pub fn parse(s: &str) -> Option<Result<Self, StoreError>> {
        if let Some(rest) = s.strip_prefix("hf:") {
            return Some(Self::parse_hf(rest));
        }
        s.strip_prefix("ollama:").map(Self::parse_ollama)
    }

    /// `USER/REPO[:QUANT]`.
    pub fn parse_hf(s: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::BadName(format!("{s:?} (want USER/REPO or USER/REPO:QUANT)"));
        if s.len() > MAX_NAME {
            return Err(bad());
        }
        let (repo, quant) = match s.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (s, None),
        };
        let mut parts = repo.split('/');
        let (Some(user), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        if !component_ok(user) || !component_ok(name) || quant.is_some_and(|q| !component_ok(q)) {
            return Err(bad());
        }
        Ok(Self::HuggingFace { repo: repo.to_string(), quant: quant.map(str::to_string) })
    }

    /// `NAME[:TAG]` or `HOST/NAMESPACE/NAME[:TAG]` (`NAMESPACE/NAME` on Ollama's registry).
    pub fn parse_ollama(s: &str) -> Result<Self, StoreError> {
        let bad = || StoreError::BadName(format!("{s:?} (want NAME, NAME:TAG or NAMESPACE/NAME:TAG)"));
        if s.len() > MAX_NAME {
            return Err(bad());
        }
        let (name, tag) = match s.rsplit_once(':') {
            Some((n, t)) => (n, t),
            None => (s, "latest"),
        };
        let parts: Vec<&str> = name.split('/').collect();
        if parts.len() > 3 || !parts.iter().all(|p| component_ok(p)) || !component_ok(tag) {
            return Err(bad());
        }
        Ok(Self::Ollama { name: name.to_string(), tag: tag.to_string() })
    }

    /// The name as the store lists it.
    pub fn display(&self) -> String {
        match self {
            Self::HuggingFace { repo, quant } => {
                format!("{repo}:{}", quant.as_deref().unwrap_or(DEFAULT_QUANT))
            }
            Self::Ollama { name, tag } => format!("{name}:{tag}"),
        }
    }
}

/// The quant tag in a GGUF file name (`Qwen3-1.7B-Q4_K_M.gguf` gives `Q4_K_M`), upper case.
pub fn quant_of_file_name(file: &str) -> Option<&'static str> {
    let stem = file.strip_suffix(".gguf").unwrap_or(file);
    let stem = strip_split_suffix(stem).0.to_ascii_uppercase();
    let bounded = |at: usize, len: usize| {
        let before = at == 0 || matches!(stem.as_bytes()[at - 1], b'-' | b'.' | b'_');
        let after = at + len == stem.len() || matches!(stem.as_bytes()[at + len], b'-' | b'.' | b'_');
        before && after
    };
    let mut best: Option<&'static str> = None;
    for tag in QUANT_TAGS {
        let found = stem.match_indices(tag).any(|(at, _)| bounded(at, tag.len()));
        if found && best.is_none_or(|b| tag.len() > b.len()) {
            best = Some(tag);
        }
    }
    best
}

/// `NAME-00001-of-00003` gives (`NAME`, Some((1, 3))); other stems are returned whole.
fn strip_split_suffix(stem: &str) -> (&str, Option<(u32, u32)>) {
    let Some((head, count)) = stem.rsplit_once("-of-") else { return (stem, None) };
    let Some((name, index)) = head.rsplit_once('-') else { return (stem, None) };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    match (digits(index), digits(count), index.parse(), count.parse()) {
        (true, true, Ok(i), Ok(n)) if i >= 1 && i <= n => (name, Some((i, n))),
        _ => (stem, None),
    }
}

/// Whether a GGUF file name is a vision projector's.
fn is_mmproj(file: &str) -> bool {
    file.to_ascii_lowercase().contains("mmproj")
}

/// The store's directories.
#[derive(Debug, Clone)]
pub struct Store {
    /// Hugging Face's hub cache.
    pub hub: PathBuf,
    /// Ollama's stores, in the order they are searched.
    pub ollama: Vec<PathBuf>,
}

impl Store {
    /// The directories the environment names (see the module's header).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home = var("HOME");
        let hub = var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| home.as_ref().map(|h| h.join(".cache/huggingface/hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let ollama = match var("OLLAMA_MODELS") {
            Some(dir) => vec![dir],
            None => {
                let mut dirs: Vec<PathBuf> = home.iter().map(|h| h.join(".ollama/models")).collect();
                dirs.push(PathBuf::from("/usr/share/ollama/.ollama/models"));
                dirs
            }
        };
        Self { hub, ollama }
    }

    /// Every model in the store, sorted by name; what cannot be read is named in the second list
    /// (a store another program is writing may hold half a repository).
    pub fn list(&self) -> (Vec<StoredModel>, Vec<String>) {
        let (mut models, mut problems) = (Vec::new(), Vec::new());
        let hub_ok = check_dir(&self.hub, true).map_err(|e| problems.push(e.to_string())).is_ok();
        if let Some(Ok(entries)) = hub_ok.then(|| fs::read_dir(&self.hub)) {
            let mut repos: Vec<String> = entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|d| repo_of_dir(&d))
                .collect();
            repos.sort();
            for repo in repos {
                match self.hf_models(&repo) {
                    Ok(found) => models.extend(found),
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
        for root in &self.ollama {
            match check_dir(root, false) {
                Ok(()) => models.extend(ollama_models(root, &mut problems)),
                Err(e) => problems.push(e.to_string()),
            }
        }
        models.sort_by(|a, b| a.name.cmp(&b.name));
        models.dedup_by(|a, b| a.name == b.name);
        (models, problems)
    }

    /// The model a name gives: for a Hugging Face repository without a quant, its
    /// [`DEFAULT_QUANT`] file, else its first one.
    pub fn find(&self, r: &ModelRef) -> Result<StoredModel, StoreError> {
        match r {
            ModelRef::HuggingFace { repo, quant } => {
                check_dir(&self.hub, true)?;
                let found = self.hf_models(repo)?;
                let not_found = |found: &[StoredModel]| StoreError::NotFound {
                    name: r.display(),
                    known: found.iter().map(|m| m.name.clone()).collect(),
                };
                let want = quant.as_deref().unwrap_or(DEFAULT_QUANT).to_ascii_uppercase();
                let tagged = |m: &StoredModel| {
                    m.name.rsplit_once(':').is_some_and(|(_, q)| q.eq_ignore_ascii_case(&want))
                };
                if let Some(m) = found.iter().find(|m| tagged(m)) {
                    return Ok(m.clone());
                }
                match (quant, found.first()) {
                    (None, Some(first)) => Ok(first.clone()),
                    _ => Err(not_found(&found)),
                }
            }
            ModelRef::Ollama { name, tag } => {
                for root in &self.ollama {
                    check_dir(root, false)?;
                    if let Some(m) = ollama_model(root, name, tag)? {
                        return Ok(m);
                    }
                }
                Err(StoreError::NotFound { name: r.display(), known: Vec::new() })
            }
        }
    }

    /// The models of one hub repository (`USER/REPO`), at the commit `refs/main` names (the
    /// caller has checked the hub's own directory).
    fn hf_models(&self, repo: &str) -> Result<Vec<StoredModel>, StoreError> {
        let dir = self.hub.join(repo_dir(repo));
        check_dir(&dir, true)?;
        let commit = match fs::read_to_string(dir.join("refs/main")) {
            Ok(c) => c.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::Io(format!("{}: {e}", dir.join("refs/main").display()))),
        };
        if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(StoreError::Corrupt(format!("{}: refs/main is not a commit hash", dir.display())));
        }
        let snapshot = dir.join("snapshots").join(&commit);
        let real_dir = dir.canonicalize().map_err(|e| StoreError::Io(format!("{}: {e}", dir.display())))?;
        let mut files = Vec::new();
        gguf_files(&snapshot, &snapshot, &real_dir, 0, &mut files)?;
        files.sort();
        Ok(group_hf(repo, &snapshot, &files))
    }

    /// Removes a Hugging Face model: its snapshot files, and each blob no other snapshot file of
    /// the repository still links to. Ollama's models are refused ([`StoreError::ReadOnly`]).
    pub fn remove(&self, r: &ModelRef) -> Result<StoredModel, StoreError> {
        let m = self.find(r)?;
        let ModelRef::HuggingFace { repo, .. } = r else { return Err(StoreError::ReadOnly(m.name)) };
        let dir = self.hub.join(repo_dir(repo));
        let io = |p: &Path, e: std::io::Error| StoreError::Io(format!("{}: {e}", p.display()));
        let mut blobs = Vec::new();
        // (The repository's projector stays: other quants of the repository share it.)
        for f in &m.files {
            if let Ok(target) = fs::canonicalize(f) {
                blobs.push(target);
            }
            fs::remove_file(f).map_err(|e| io(f, e))?;
        }
        // Blobs still linked from any snapshot stay.
        let mut linked = Vec::new();
        if let Ok(snaps) = fs::read_dir(dir.join("snapshots")) {
            for s in snaps.flatten() {
                collect_links(&s.path(), 0, &mut linked);
            }
        }
        // (Without a blobs directory no target is a blob: a snapshot of plain files.)
        let Ok(blob_dir) = dir.join("blobs").canonicalize() else { return Ok(m) };
        for b in blobs {
            if b.starts_with(&blob_dir) && !linked.contains(&b) {
                fs::remove_file(&b).map_err(|e| io(&b, e))?;
            }
        }
        Ok(m)
    }
}

/// `models--USER--REPO` for `USER/REPO`.
fn repo_dir(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// `USER/REPO` for a hub directory `models--USER--REPO` whose parts are safe names.
fn repo_of_dir(dir: &str) -> Option<String> {
    let rest = dir.strip_prefix("models--")?;
    let (user, name) = rest.split_once("--")?;
    (component_ok(user) && component_ok(name)).then(|| format!("{user}/{name}"))
}

/// Deepest directory nesting read inside a snapshot.
const MAX_DEPTH: usize = 8;

/// The `.gguf` files under `dir` (relative to `snapshot`), each resolving inside `repo` (a
/// canonical path).
fn gguf_files(
    dir: &Path,
    snapshot: &Path,
    repo: &Path,
    depth: usize,
    out: &mut Vec<PathBuf>,
) -> Result<(), StoreError> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    let Ok(entries) = fs::read_dir(dir) else { return Ok(()) };
    for e in entries.flatten() {
        let path = e.path();
        let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
        if name.starts_with('.') {
            continue;
        }
        let Ok(real) = fs::canonicalize(&path) else { continue }; // a dangling link: a blob not yet there
        if !real.starts_with(repo) {
            return Err(StoreError::Corrupt(format!("{} points outside its repository", path.display())));
        }
        if real.is_dir() {
            gguf_files(&path, snapshot, repo, depth + 1, out)?;
        } else if name.ends_with(".gguf") {
            out.push(path.strip_prefix(snapshot).unwrap_or(&path).to_path_buf());
        }
    }
    Ok(())
}

/// Every link target under `dir`, resolved.
fn collect_links(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    if depth > MAX_DEPTH {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            collect_links(&path, depth + 1, out);
        } else if let Ok(real) = fs::canonicalize(&path) {
            out.push(real);
        }
    }
}

/// One model per quant tag (or file stem) of a repository's GGUF files: split parts joined in
/// order (a model missing a part is left out), the repository's projector attached to each.
fn group_hf(repo: &str, snapshot: &Path, files: &[PathBuf]) -> Vec<StoredModel> {
    let name_of = |p: &PathBuf| p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
    let mmproj = files.iter().find(|f| is_mmproj(&name_of(f))).map(|f| snapshot.join(f));
    let mut models: Vec<StoredModel> = Vec::new();
    let mut parts: Vec<(String, u32, u32, PathBuf)> = Vec::new();
    for f in files.iter().filter(|f| !is_mmproj(&name_of(f))) {
        let file = name_of(f);
        let stem = file.strip_suffix(".gguf").unwrap_or(&file);
        let (base, split) = strip_split_suffix(stem);
        let tag = quant_of_file_name(&file).map(str::to_string).unwrap_or_else(|| base.to_string());
        let name = format!("{repo}:{tag}");
        match split {
            Some((i, n)) => parts.push((name, i, n, snapshot.join(f))),
            None => models.push(StoredModel {
                name,
                source: Source::HuggingFace,
                bytes: fs::metadata(snapshot.join(f)).map(|m| m.len()).unwrap_or(0),
                files: vec![snapshot.join(f)],
                mmproj: mmproj.clone(),
            }),
        }
    }
    parts.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for group in parts.chunk_by(|a, b| a.0 == b.0 && a.2 == b.2) {
        let n = group[0].2;
        let complete =
            group.len() == n as usize && group.iter().enumerate().all(|(k, p)| p.1 == k as u32 + 1);
        if complete {
            let files: Vec<PathBuf> = group.iter().map(|p| p.3.clone()).collect();
            models.push(StoredModel {
                name: group[0].0.clone(),
                source: Source::HuggingFace,
                bytes: files.iter().map(|f| fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum(),
                files,
                mmproj: mmproj.clone(),
            });
        }
    }
    models.sort_by(|a, b| a.name.cmp(&b.name));
    models.dedup_by(|a, b| a.name == b.name);
    models
}

/// Ollama's host and namespace of its own registry (left out of names).
const OLLAMA_HOST: &str = "registry.ollama.ai";
const OLLAMA_LIBRARY: &str = "library";
/// Largest manifest read (Ollama's are a few hundred bytes).
const MAX_MANIFEST: u64 = 1 << 20;

/// Every model of an Ollama store; what cannot be read goes to `problems`.
fn ollama_models(root: &Path, problems: &mut Vec<String>) -> Vec<StoredModel> {
    let mut out = Vec::new();
    let manifests = root.join("manifests");
    let list = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .map(|es| {
                es.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| component_ok(n))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    for host in list(&manifests) {
        for ns in list(&manifests.join(&host)) {
            for name in list(&manifests.join(&host).join(&ns)) {
                for tag in list(&manifests.join(&host).join(&ns).join(&name)) {
                    let full = match (host.as_str(), ns.as_str()) {
                        (OLLAMA_HOST, OLLAMA_LIBRARY) => name.clone(),
                        (OLLAMA_HOST, _) => format!("{ns}/{name}"),
                        _ => format!("{host}/{ns}/{name}"),
                    };
                    match ollama_model(root, &full, &tag) {
                        Ok(Some(m)) => out.push(m),
                        Ok(None) => {}
                        Err(e) => problems.push(e.to_string()),
                    }
                }
            }
        }
    }
    out
}

/// One Ollama model by `NAME` (or `NAMESPACE/NAME`, `HOST/NAMESPACE/NAME`) and tag; `None` when
/// the store has no manifest for it.
fn ollama_model(root: &Path, name: &str, tag: &str) -> Result<Option<StoredModel>, StoreError> {
    let parts: Vec<&str> = name.split('/').collect();
    let (host, ns, base) = match parts[..] {
        [n] => (OLLAMA_HOST, OLLAMA_LIBRARY, n),
        [s, n] => (OLLAMA_HOST, s, n),
        [h, s, n] => (h, s, n),
        _ => return Err(StoreError::BadName(name.to_string())),
    };
    if ![host, ns, base, tag].iter().all(|p| component_ok(p)) {
        return Err(StoreError::BadName(format!("{name}:{tag}")));
    }
    let path = root.join("manifests").join(host).join(ns).join(base).join(tag);
    let bytes = match fs::metadata(&path) {
        Ok(m) if m.len() > MAX_MANIFEST => {
            return Err(StoreError::Corrupt(format!("{}: a manifest of {} bytes", path.display(), m.len())))
        }
        Ok(_) => fs::read(&path).map_err(|e| StoreError::Io(format!("{}: {e}", path.display())))?,
        Err(_) => return Ok(None),
    };
    let corrupt = |why: &str| StoreError::Corrupt(format!("{}: {why}", path.display()));
    let manifest: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| corrupt(&e.to_string()))?;
    let layers = manifest["layers"].as_array().ok_or_else(|| corrupt("no layers"))?;
    let blob = |media: &str| -> Result<Option<PathBuf>, StoreError> {
        let Some(layer) = layers.iter().find(|l| l["mediaType"] == media) else { return Ok(None) };
        let digest = layer["digest"].as_str().ok_or_else(|| corrupt("a layer without a digest"))?;
        let hex = digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        let hex = hex.ok_or_else(|| corrupt(&format!("bad digest {digest:?}")))?;
        Ok(Some(root.join("blobs").join(format!("sha256-{hex}"))))
    };
    let Some(model) = blob("application/vnd.ollama.image.model")? else { return Ok(None) };
    let bytes =
        fs::metadata(&model).map_err(|e| corrupt(&format!("model blob {}: {e}", model.display())))?.len();
    Ok(Some(StoredModel {
        name: format!("{name}:{tag}"),
        source: Source::Ollama,
        files: vec![model],
        mmproj: blob("application/vnd.ollama.image.projector")?,
        bytes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_tags_come_from_file_names() {
        assert_eq!(quant_of_file_name("Qwen3-1.7B-Q4_K_M.gguf"), Some("Q4_K_M"));
        assert_eq!(quant_of_file_name("smollm2-135m-instruct-q8_0.gguf"), Some("Q8_0"));
        assert_eq!(quant_of_file_name("model.IQ4_XS.gguf"), Some("IQ4_XS"));
        assert_eq!(quant_of_file_name("big-Q4_K_M-00002-of-00003.gguf"), Some("Q4_K_M"));
        assert_eq!(quant_of_file_name("gemma-3-270m-it-BF16.gguf"), Some("BF16"));
        assert_eq!(quant_of_file_name("model.gguf"), None);
        assert_eq!(quant_of_file_name("xq4_0y.gguf"), None);
        assert_eq!(strip_split_suffix("m-00002-of-00003"), ("m", Some((2, 3))));
        assert_eq!(strip_split_suffix("m-00004-of-00003"), ("m-00004-of-00003", None));
    }

    #[test]
    fn names_with_path_characters_are_refused() {
        assert!(ModelRef::parse_hf("unsloth/Qwen3-1.7B-GGUF:Q4_K_M").is_ok());
        for bad in ["../x/y", "a/../b", "/abs/path", "a/b/c", "a", "a/b:../c", "a/.b", "a/b:", "a\\b/c", ""] {
            assert!(ModelRef::parse_hf(bad).is_err(), "{bad}");
        }
        assert_eq!(
            ModelRef::parse("ollama:qwen3").unwrap().unwrap(),
            ModelRef::Ollama { name: "qwen3".into(), tag: "latest".into() }
        );
        for bad in ["../x", "a/b/c/d:t", "x:../t", "x:", ".x"] {
            assert!(ModelRef::parse_ollama(bad).is_err(), "{bad}");
        }
        assert!(ModelRef::parse("./model.gguf").is_none());
    }
}
