//! Links the image with link.ld, and embeds the model named by PINFER_EMBED_MODEL when the
//! `embed-model` feature is on.
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    println!("cargo:rustc-link-arg=-T{}", dir.join("link.ld").display());
    println!("cargo:rerun-if-changed=link.ld");
    println!("cargo:rerun-if-env-changed=PINFER_EMBED_MODEL");
    println!("cargo:rerun-if-env-changed=PINFER_EMBED_PROMPT");
    if std::env::var_os("CARGO_FEATURE_EMBED_MODEL").is_some() {
        let Some(model) = std::env::var_os("PINFER_EMBED_MODEL") else {
            panic!("the embed-model feature needs PINFER_EMBED_MODEL=path/to/model.gguf");
        };
        let model = std::fs::canonicalize(&model)
            .unwrap_or_else(|e| panic!("{}: {e}", PathBuf::from(&model).display()));
        println!("cargo:rerun-if-changed={}", model.display());
        println!("cargo:rustc-env=PINFER_EMBEDDED_MODEL_PATH={}", model.display());
    }
}
