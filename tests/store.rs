//! The model store (`pinfer list`, `show`, `rm`, `-m hf:...` / `-m ollama:...`) over a Hugging
//! Face hub cache and an Ollama store laid out as huggingface_hub and Ollama write them (blobs,
//! snapshot links, refs; manifests and `sha256-` blobs), in a temporary directory.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pinfer::store::{ModelRef, Source, Store, StoreError};
use serde_json::Value;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pinfer-store-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// Puts `files` (path in the repository, source file) into the hub cache `hub` as repository
/// `repo` at [`COMMIT`]: each a blob named by its content's stand-in digest, linked from the
/// snapshot by a relative link, as huggingface_hub does.
fn hub_repo(hub: &Path, repo: &str, files: &[(&str, &Path)]) -> PathBuf {
    let dir = hub.join(format!("models--{}", repo.replace('/', "--")));
    fs::create_dir_all(dir.join("blobs")).unwrap();
    fs::create_dir_all(dir.join("refs")).unwrap();
    fs::write(dir.join("refs/main"), COMMIT).unwrap();
    for (i, (name, src)) in files.iter().enumerate() {
        let blob = format!("{:064x}", i + 1);
        fs::copy(src, dir.join("blobs").join(&blob)).unwrap();
        let link = dir.join("snapshots").join(COMMIT).join(name);
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = name.matches('/').count();
        let up = "../".repeat(2 + depth);
        symlink(format!("{up}blobs/{blob}"), &link).unwrap();
    }
    dir
}

/// An Ollama store under `root` with model `name:tag` whose model layer is `gguf`.
fn ollama_model(root: &Path, name: &str, tag: &str, gguf: &Path, digest_hex: &str) {
    fs::create_dir_all(root.join("blobs")).unwrap();
    fs::copy(gguf, root.join("blobs").join(format!("sha256-{digest_hex}"))).unwrap();
    let dir = root.join("manifests/registry.ollama.ai/library").join(name);
    fs::create_dir_all(&dir).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": format!("sha256:{}", "0".repeat(64)), "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": format!("sha256:{digest_hex}"), "size": fs::metadata(gguf).unwrap().len()},
            {"mediaType": "application/vnd.ollama.image.template", "digest": format!("sha256:{}", "1".repeat(64)), "size": 10},
        ],
    });
    fs::write(dir.join(tag), manifest.to_string()).unwrap();
}

fn pinfer(hub: &Path, ollama: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pinfer"))
        .args(args)
        .env("HF_HUB_CACHE", hub)
        .env("OLLAMA_MODELS", ollama)
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn stored_models_are_listed_shown_run_and_removed() {
    let dir = scratch("list");
    let (hub, ollama) = (dir.join("hub"), dir.join("ollama"));
    let tiny = root().join("models/tiny");
    let repo = hub_repo(
        &hub,
        "someone/Tiny-GGUF",
        &[
            ("tiny-Q8_0.gguf", &tiny.join("qwen2-tiny.gguf")),
            ("sub/tiny-Q4_K_M.gguf", &tiny.join("qwen3-tiny.gguf")),
            ("README.md", &root().join("LICENSE-MIT")),
        ],
    );
    hub_repo(&hub, "someone/Embed-GGUF", &[("embed-F16.gguf", &tiny.join("bert-tiny.gguf"))]);
    ollama_model(&ollama, "tinyq", "latest", &tiny.join("qwen2-tiny.gguf"), &"a".repeat(64));

    // The library's view.
    let store = Store { hub: hub.clone(), ollama: vec![ollama.clone()] };
    let (models, problems) = store.list();
    assert!(problems.is_empty(), "{problems:?}");
    let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        ["someone/Embed-GGUF:F16", "someone/Tiny-GGUF:Q4_K_M", "someone/Tiny-GGUF:Q8_0", "tinyq:latest"]
    );
    let default = store.find(&ModelRef::parse_hf("someone/Tiny-GGUF").unwrap()).unwrap();
    assert_eq!(default.name, "someone/Tiny-GGUF:Q4_K_M", "the default quant");
    let q8 = store.find(&ModelRef::parse_hf("someone/Tiny-GGUF:q8_0").unwrap()).unwrap();
    assert_eq!(q8.files, [repo.join("snapshots").join(COMMIT).join("tiny-Q8_0.gguf")]);
    match store.find(&ModelRef::parse_hf("someone/Tiny-GGUF:Q6_K").unwrap()) {
        Err(StoreError::NotFound { known, .. }) => assert_eq!(known.len(), 2),
        other => panic!("{other:?}"),
    }
    assert_eq!(store.find(&ModelRef::parse_ollama("tinyq").unwrap()).unwrap().source, Source::Ollama);

    // The CLI's.
    let out = pinfer(&hub, &ollama, &["list", "--json"]);
    assert!(out.status.success(), "{:?}", text(&out));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let caps = |name: &str| {
        listed["models"].as_array().unwrap().iter().find(|m| m["name"] == name).unwrap()["capabilities"]
            .clone()
    };
    assert_eq!(caps("someone/Embed-GGUF:F16"), serde_json::json!(["embedding"]));
    assert_eq!(caps("someone/Tiny-GGUF:Q8_0")[0], "completion");
    let out = pinfer(&hub, &ollama, &["list"]);
    let (table, _) = text(&out);
    assert!(table.contains("hf:someone/Tiny-GGUF:Q8_0") && table.contains("ollama:tinyq:latest"), "{table}");
    let out = pinfer(&hub, &ollama, &["show", "hf:someone/Tiny-GGUF:Q8_0"]);
    assert!(text(&out).0.contains("architecture  qwen2"), "{:?}", text(&out));

    // A stored model runs by name, from the store and from Ollama's blob, as its file does.
    let run = |model: &str| {
        let out = pinfer(&hub, &ollama, &["generate", "-m", model, "-p", "Hello", "-n", "4", "--temp", "0"]);
        assert!(out.status.success(), "{model}: {:?}", text(&out));
        text(&out).0
    };
    let by_file = run(tiny.join("qwen2-tiny.gguf").to_str().unwrap());
    assert_eq!(run("hf:someone/Tiny-GGUF:Q8_0"), by_file);
    assert_eq!(run("ollama:tinyq"), by_file);
    // llama.cpp's spelling: -hf USER/REPO[:QUANT] (and --hf-repo=).
    for flags in [&["-hf", "someone/Tiny-GGUF:Q8_0"][..], &["--hf-repo=someone/Tiny-GGUF:q8_0"]] {
        let mut args = vec!["generate", "-p", "Hello", "-n", "4", "--temp", "0"];
        args.extend_from_slice(flags);
        let out = pinfer(&hub, &ollama, &args);
        assert!(out.status.success(), "{flags:?}: {:?}", text(&out));
        assert_eq!(text(&out).0, by_file, "{flags:?}");
    }

    // rm: the model's link and blob go, the other quant and the Ollama model stay.
    let out = pinfer(&hub, &ollama, &["rm", "ollama:tinyq"]);
    assert!(!out.status.success() && text(&out).1.contains("ollama rm"), "{:?}", text(&out));
    let out = pinfer(&hub, &ollama, &["rm", "hf:someone/Tiny-GGUF:Q8_0"]);
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(!repo.join("blobs").join(format!("{:064x}", 1)).exists());
    assert!(repo.join("blobs").join(format!("{:064x}", 2)).exists());
    let out = pinfer(&hub, &ollama, &["generate", "-m", "hf:someone/Tiny-GGUF:Q8_0", "-p", "Hi", "-n", "1"]);
    let (_, err) = text(&out);
    assert!(
        !out.status.success() && err.contains("not in the model store") && err.contains("Q4_K_M"),
        "{err}"
    );
    assert_eq!(store.list().0.len(), 3);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hostile_stores_and_names_are_refused_by_name() {
    let dir = scratch("hostile");
    let (hub, ollama) = (dir.join("hub"), dir.join("ollama"));
    let tiny = root().join("models/tiny/qwen2-tiny.gguf");
    // A snapshot link that leaves its repository.
    let repo = hub_repo(&hub, "evil/Out-GGUF", &[]);
    fs::create_dir_all(repo.join("snapshots").join(COMMIT)).unwrap();
    symlink(&tiny, repo.join("snapshots").join(COMMIT).join("x-Q8_0.gguf")).unwrap();
    // refs/main that is not a commit.
    let bad_ref = hub_repo(&hub, "evil/Ref-GGUF", &[]);
    fs::write(bad_ref.join("refs/main"), "../../../etc").unwrap();
    // Ollama manifests: a digest with path characters, and one too large to be a manifest.
    ollama_model(&ollama, "good", "latest", &tiny, &"b".repeat(64));
    let manifests = ollama.join("manifests/registry.ollama.ai/library");
    fs::create_dir_all(manifests.join("evil")).unwrap();
    let evil = serde_json::json!({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../../etc/passwd"}]});
    fs::write(manifests.join("evil/latest"), evil.to_string()).unwrap();
    fs::create_dir_all(manifests.join("huge")).unwrap();
    fs::write(manifests.join("huge/latest"), vec![b' '; (1 << 20) + 1]).unwrap();

    let store = Store { hub: hub.clone(), ollama: vec![ollama.clone()] };
    let (models, problems) = store.list();
    let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["good:latest"], "{problems:?}");
    let all = problems.join("\n");
    assert!(all.contains("outside its repository") && all.contains("not a commit hash"), "{all}");
    match store.find(&ModelRef::parse_ollama("evil").unwrap()) {
        Err(StoreError::Corrupt(why)) => assert!(why.contains("bad digest"), "{why}"),
        other => panic!("{other:?}"),
    }
    match store.find(&ModelRef::parse_ollama("huge").unwrap()) {
        Err(StoreError::Corrupt(why)) => assert!(why.contains("manifest of"), "{why}"),
        other => panic!("{other:?}"),
    }
    for name in ["hf:../x/y", "hf:a/b/c", "ollama:../../x", "ollama:x:../y"] {
        let out = pinfer(&hub, &ollama, &["generate", "-m", name, "-p", "x", "-n", "1"]);
        let (_, err) = text(&out);
        assert!(!out.status.success() && err.contains("not a model name"), "{name}: {err}");
    }
    // The list still lists what it can, and says what it could not read.
    let out = pinfer(&hub, &ollama, &["list"]);
    let (table, err) = text(&out);
    assert!(
        out.status.success() && table.contains("ollama:good:latest") && err.contains("warning"),
        "{table}{err}"
    );
    // A store anybody may write is refused with the reason, and the models in it are not run.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&ollama, fs::Permissions::from_mode(0o777)).unwrap();
    let out = pinfer(&hub, &ollama, &["generate", "-m", "ollama:good", "-p", "x", "-n", "1"]);
    let (_, err) = text(&out);
    assert!(!out.status.success() && err.contains("writable by every user"), "{err}");
    assert!(Store { hub: hub.clone(), ollama: vec![ollama.clone()] }.list().0.is_empty());
    fs::set_permissions(&ollama, fs::Permissions::from_mode(0o755)).unwrap();
    // Nothing was changed.
    assert!(tiny.exists() && repo.join("snapshots").join(COMMIT).join("x-Q8_0.gguf").exists());
    fs::remove_dir_all(&dir).unwrap();
}
