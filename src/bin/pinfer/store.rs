//! `pinfer list`, `pinfer show NAME`, `pinfer rm NAME`: the models of the store
//! ([`pinfer::store`]: Hugging Face's hub cache and Ollama's store, read in place), and the
//! resolution of a store name given to `-m`.

use std::path::Path;

use pinfer::gguf::Gguf;
use pinfer::loader::ModelFile;
use pinfer::model::HParams;
use pinfer::store::{ModelRef, Source, Store, StoredModel};
use serde_json::{json, Value as Json};

use crate::CliError;

/// The stored model a name gives, as one GGUF file pinfer can map.
pub fn resolve(r: &ModelRef) -> Result<StoredModel, CliError> {
    let store = Store::from_env();
    let m = store.find(r).map_err(|e| match (&e, r) {
        (pinfer::store::StoreError::NotFound { .. }, ModelRef::HuggingFace { repo, .. }) => {
            CliError::new(format!(
                "{e}; the store is {} (fetch the file with `hf download {repo} FILE.gguf`)",
                store.hub.display()
            ))
        }
        _ => CliError::new(e.to_string()),
    })?;
    if m.files.len() > 1 {
        return Err(CliError::new(format!(
            "{}: a GGUF split in {} parts; pinfer maps one file (join them with llama.cpp's `llama-gguf-split --merge`)",
            m.name,
            m.files.len()
        )));
    }
    Ok(m)
}

/// What `list` and `show` tell of a model, read from its GGUF header.
struct Facts {
    arch: String,
    context: u32,
    quant: String,
    capabilities: Vec<&'static str>,
}

fn facts(m: &StoredModel) -> Result<Facts, String> {
    let file = ModelFile::open(&m.files[0]).map_err(|e| e.to_string())?;
    let gguf: Gguf<'_> = file.parse().map_err(|e| e.to_string())?;
    let hp = HParams::from_gguf(&gguf).map_err(|e| e.to_string())?;
    let arch = gguf.get_str("general.architecture").unwrap_or("?").to_string();
    let quant = m.name.rsplit_once(':').map(|(_, q)| q.to_string()).unwrap_or_default();
    let mut capabilities = Vec::new();
    if hp.pooling.is_some() {
        capabilities.push("embedding");
    } else {
        capabilities.push("completion");
        if m.mmproj.is_some() {
            capabilities.push("vision");
        }
        if gguf.get_str("tokenizer.chat_template").is_ok_and(|t| t.contains("tools")) {
            capabilities.push("tools");
        }
    }
    Ok(Facts { arch, context: hp.n_ctx_train, quant, capabilities })
}

fn source_name(s: Source) -> &'static str {
    match s {
        Source::HuggingFace => "huggingface",
        Source::Ollama => "ollama",
    }
}

fn gib(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64),
    }
}

/// `pinfer list [--json]`.
pub fn list(as_json: bool) -> Result<(), CliError> {
    let store = Store::from_env();
    let (models, problems) = store.list();
    let rows: Vec<(StoredModel, Result<Facts, String>)> = models
        .into_iter()
        .map(|m| {
            let f = facts(&m);
            (m, f)
        })
        .collect();
    if as_json {
        let items: Vec<Json> = rows.iter().map(|(m, f)| row_json(m, f.as_ref().ok())).collect();
        println!("{}", json!({ "models": items, "problems": problems }));
        return Ok(());
    }
    println!("{:<48} {:<8} {:>9} {:<12} {:>8}  CAPABILITIES", "NAME", "QUANT", "SIZE", "ARCH", "CONTEXT");
    for (m, f) in &rows {
        let name = match m.source {
            Source::HuggingFace => format!("hf:{}", m.name),
            Source::Ollama => format!("ollama:{}", m.name),
        };
        match f {
            Ok(f) => println!(
                "{name:<48} {:<8} {:>9} {:<12} {:>8}  {}",
                f.quant,
                gib(m.bytes),
                f.arch,
                f.context,
                f.capabilities.join(",")
            ),
            Err(e) => println!("{name:<48} {:<8} {:>9} unreadable: {e}", "", gib(m.bytes)),
        }
    }
    if rows.is_empty() {
        eprintln!(
            "no models in {} or {} (Hugging Face's hub cache: HF_HUB_CACHE / HF_HOME; Ollama's: OLLAMA_MODELS)",
            store.hub.display(),
            store.ollama.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    for p in problems {
        eprintln!("warning: {p}");
    }
    Ok(())
}

fn row_json(m: &StoredModel, f: Option<&Facts>) -> Json {
    let path = |p: &Path| p.display().to_string();
    json!({
        "name": m.name,
        "source": source_name(m.source),
        "files": m.files.iter().map(|p| path(p)).collect::<Vec<_>>(),
        "mmproj": m.mmproj.as_deref().map(path),
        "size": m.bytes,
        "architecture": f.map(|f| f.arch.clone()),
        "context_length": f.map(|f| f.context),
        "quantization": f.map(|f| f.quant.clone()),
        "capabilities": f.map(|f| f.capabilities.clone()),
    })
}

fn parse_name(name: &str) -> Result<ModelRef, CliError> {
    match ModelRef::parse(name) {
        Some(r) => r.map_err(|e| CliError::new(e.to_string())),
        None => {
            Err(CliError::new(format!("{name}: a store name is hf:USER/REPO[:QUANT] or ollama:NAME[:TAG]")))
        }
    }
}

/// `pinfer show NAME [--json]`.
pub fn show(name: &str, as_json: bool) -> Result<(), CliError> {
    let m = Store::from_env().find(&parse_name(name)?).map_err(|e| CliError::new(e.to_string()))?;
    let f = facts(&m).map_err(|e| CliError::new(format!("{}: {e}", m.name)))?;
    if as_json {
        println!("{}", row_json(&m, Some(&f)));
        return Ok(());
    }
    println!("name          {}", m.name);
    println!("source        {}", source_name(m.source));
    for p in &m.files {
        println!("file          {}", p.display());
    }
    if let Some(p) = &m.mmproj {
        println!("mmproj        {}", p.display());
    }
    println!("size          {}", gib(m.bytes));
    println!("architecture  {}", f.arch);
    println!("context       {}", f.context);
    println!("quantization  {}", f.quant);
    println!("capabilities  {}", f.capabilities.join(", "));
    Ok(())
}

/// `pinfer rm NAME`.
pub fn remove(name: &str) -> Result<(), CliError> {
    let m = Store::from_env().remove(&parse_name(name)?).map_err(|e| CliError::new(e.to_string()))?;
    println!("deleted '{}' ({})", m.name, gib(m.bytes));
    Ok(())
}
